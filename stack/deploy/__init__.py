"""What ``docker compose -f deploy/compose.yaml up`` runs before and beside the services: the
one-shot init that makes every secret and certificate, the first admin token's seeding, a
training node's bundle, and the containers' health checks (docs/security.md)."""
