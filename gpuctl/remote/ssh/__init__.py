"""A host over SSH: SshHost (host.py) on Fabric, the chain of jump hosts it connects through
(connect.py), OpenSSH's argv and config for what runs outside Python (openssh.py), `--host`
aliases read from the user's ssh config (resolve.py) and the pins of host keys (known_hosts.py)."""
