"""Files: the output policy (atomic writes), safetensors saving, project config, JSON reports."""
