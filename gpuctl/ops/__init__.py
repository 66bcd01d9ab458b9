"""The use cases, one module per concern (docs/architecture.md lists them); each takes a Session
(session.py) first, returns typed results (gpuctl.model) and never prints.

Provider differences never show here: they are answered by the Provider (gpuctl.provision) and
the Host (gpuctl.remote.host) protocols.
"""
