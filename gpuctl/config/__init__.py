"""Settings: their schema (settings.py), the layered loading of files, environment and flags
(load.py), the provider names a setting may take (providers.py) and the TensorFlow releases `up`
accepts (tf_releases.py). Below the use cases and providers; imports only the model."""
