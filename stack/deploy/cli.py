"""``greyhound deploy``: the init volume of deploy/compose.yaml and what operators ask of it
(docs/security.md). Compose runs ``deploy --dir /deploy init`` as its one-shot ``init`` service
and ``deploy migrate`` as its ``migrate`` step; the rest are ``docker compose run`` commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from services.common.settings import Settings

HELP = "the compose deployment's secrets, certificates and first admin token"
RELOAD = "docker compose -f deploy/compose.yaml kill -s HUP nats"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from stack.deploy.volume import Rotatable

    p = sub.add_parser("deploy", help=HELP, description=HELP)
    p.add_argument("--dir", type=Path, default=None,
                   help="the init volume (compose mounts it at /deploy)")
    dsub = p.add_subparsers(dest="deploy_command", required=True)
    dsub.add_parser("init", help="make what is missing, apply deploy/.env, keep the rest")
    node = dsub.add_parser("node", help="a training node's credentials, as a tar on stdout "
                           "(adds its agent's bus user)")
    node.add_argument("agent_id")
    dsub.add_parser("admin-token", help="print the first admin token")
    rot = dsub.add_parser("rotate", help="make new bus passwords, certificates or token key")
    rot.add_argument("what", choices=get_args(Rotatable))
    mig = dsub.add_parser("migrate", help="migrate the schema, then seed the first admin token")
    mig.add_argument("--first-admin", type=Path, required=True,
                     help="the record init wrote for this step")


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.deploy_command == "migrate":
        from stack.deploy.first_admin import migrate

        if settings.database_url is None:
            print("greyhound deploy migrate: GREYHOUND_DATABASE_URL is not set", file=sys.stderr)
            return 2
        print(migrate(settings.database_url, args.first_admin), flush=True)
        return 0
    if args.dir is None:
        print(f"greyhound deploy {args.deploy_command}: --dir is required", file=sys.stderr)
        return 2
    from stack.deploy.settings import DeploySettings
    from stack.deploy.volume import DeployVolume

    volume = DeployVolume(args.dir, DeploySettings())
    if args.deploy_command == "admin-token":
        print(volume.admin_token())
        return 0
    if args.deploy_command == "node":
        bundle = volume.node_bundle(args.agent_id)
        sys.stdout.buffer.write(bundle)
        sys.stdout.flush()
        print(f"node {args.agent_id}: credentials written (tar); now reload NATS: {RELOAD}",
              file=sys.stderr)
        if not volume.settings.nats_names():
            print("GREYHOUND_DEPLOY_NATS_HOSTS is unset in deploy/.env: agent.env names `nats`, which "
                  "only containers of this deployment resolve (docs/security.md)",
                  file=sys.stderr)
        return 0
    said = volume.rotate(args.what) if args.deploy_command == "rotate" else volume.init()
    for item in said.made:
        print(f"made {item}", flush=True)
    print(f"kept {len(said.kept)} existing secret(s) and certificate(s) in {args.dir}", flush=True)
    if said.new_admin_token is not None:
        print("the first admin token (shown once here; `docker compose -f deploy/compose.yaml "
              f"run --rm init admin-token` prints it again):\n{said.new_admin_token}", flush=True)
    if args.deploy_command == "rotate":
        print("now recreate what uses it: docker compose -f deploy/compose.yaml up -d "
              "--force-recreate; training nodes need a new bundle (deploy node <id>)"
              if args.what != "token-key" else "every API token stopped working: make an "
              "admin one with docker compose -f deploy/compose.yaml run --rm api token create "
              "--role admin", flush=True)
    return 0
