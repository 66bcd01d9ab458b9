"""The `aws` provider: EC2 GPU instances (provider.py), their life as EC2 reports it
(lifecycle.py), and finding and releasing what gpuctl made (inventory.py)."""

from gpuctl.provision.aws.provider import AwsProvider

__all__ = ["AwsProvider"]
