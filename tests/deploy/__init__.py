"""Deployment artifact tests (Dockerfile, systemd, Kubernetes, Helm, SkyPilot, torchrun)."""
