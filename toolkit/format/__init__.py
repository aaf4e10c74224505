"""The toolkit's on-disk checkpoint format, on the lowest floor: the names of folders and files (names.py), the
checksummed manifest (manifest.py), the weights-only loaders with their allow-list (safe_load.py) and the streaming
safetensors reader (safetensors_stream.py). It imports nothing of the toolkit but toolkit.errors, so conversion,
training and both backends build on it."""
