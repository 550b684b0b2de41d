"""The engine: scheduler decisions -> tensors -> model -> sampled tokens."""
