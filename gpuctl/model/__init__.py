"""The types that cross layers: cluster specs (specs.py), records of clusters, instances and runs
(records.py), what the use cases return (results.py), images (images.py), SSH endpoints
(endpoint.py), EC2's billing rules (billing.py) and the bounds on what an instance says
(untrusted.py). Imports nothing above it."""
