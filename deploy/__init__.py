"""Deployment definitions: the local stack (``local_stack``), and later the compose file and the
Kubernetes manifests. Data only: this package imports no service package."""
