"""On-bucket formats: streaming safetensors files and the JSON manifest."""
