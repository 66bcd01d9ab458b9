"""The use cases, one module per concern; each takes a Session (session.py) first, returns typed
results (gpuctl.types) and never prints:

    clusters.py   up, down, down --all, status --all, reconcile with the provider
    runs.py       sync, train, pull, exec
    run_state.py  a run's state, epochs and log from the instance; wait; stop
    costs.py      status, cost, compare
    guards.py     arm the watchdog, guard show/set, logs --guard
    access.py     ssh, attach, ssh-config, tensorboard
    config.py     config show

Provider differences never show here: they are answered by the Provider (gpuctl.provision) and
the Host (gpuctl.remote.host) protocols. Spot recovery (recovery.py), images (images.py) and
multi-node runs (nodes.py) get their own modules here.
"""
