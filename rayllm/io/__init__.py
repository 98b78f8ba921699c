"""The bottom floor: paths on local disk or object storage (storage.py), the settings that reach
them (settings.py) and the one channel credentials travel through (credentials.py). Imports no
other rayllm room but errors."""
