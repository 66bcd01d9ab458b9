"""The providers a setting may name, each with the import path of its class: naming, listing and
checking one (settings validation, `--help`) imports no provider module and none of its heavy
dependencies. gpuctl.provision loads the class when a cluster needs it."""

from __future__ import annotations

PROVIDERS: dict[str, str] = {
    "aws": "gpuctl.provision.aws:AwsProvider",
    "local": "gpuctl.provision.local:LocalProvider",
    "ssh": "gpuctl.provision.ssh:SshProvider",
}


def unknown_provider(name: str) -> str:
    """'unknown provider X', with a did-you-mean when a known name is close (a typo like 'locl')."""
    import difflib

    close = difflib.get_close_matches(name, sorted(PROVIDERS), n=1, cutoff=0.6)
    return f"unknown provider {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
