"""The ground every layer of the gateway stands on: OpenAI's wire shapes (schemas), the error tree
and its one renderer (errors), and reading a client's JSON body safely (request_body). It imports
nothing else of the gateway but its settings."""
