"""The HTTP surface: the app, its endpoints, the wire shapes and errors, and response rendering."""
