"""``make deploy-check``: the image built, the compose files run for real (podman + Compose v2).

``deploy/deploy_check.py`` is the entry point; :mod:`deploy.check.steps` times and names
each step, :mod:`deploy.check.podman` makes the base, the image and the Docker-compatible
API service, :mod:`deploy.check.compose` drives the Compose binary against it and
:mod:`deploy.check.scenarios` holds what is checked through the published ports.
"""
