"""Deployment definitions: the local stack (``local_stack``), a NATS cluster on one machine
(``nats_cluster``), and the production artefacts: ``compose.yaml`` and the Kubernetes base ``k8s/``,
rendered by ``render`` from the local stack, and ``keygen`` for a deployment's keys and their
enrollment. Data only: this package imports no service package."""
