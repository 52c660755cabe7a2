"""The outside world: the local llama.cpp model, upstream models, stores and model files."""
