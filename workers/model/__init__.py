"""The model: Llama-family definitions built from tensor-parallel layers, their config, and
the checkpoint loaders (Hugging Face safetensors folders, GGUF files). It runs on whatever
backend (workers/backends/) the worker hands it."""
