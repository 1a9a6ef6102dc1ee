"""`hsx nats-config`: a nats-server authorization block with one user per hsx role, each allowed
only what that role does (hsx/wire/permissions.py), and each role's credentials for its services.

It writes into --out: `nats-auth.conf`, the `authorization { users = [...] }` block (passwords as
bcrypt hashes, which nats-server checks), and `<role>.env` per role, the HSX_NATS_* variables its
services run with (user, password, inbox prefix, and the URL when --url is given). With
--trainer-stream NAME the trainer role is one user per stream name instead (`hsx-trainer-NAME`,
`trainer-NAME.env`), each allowed to record its own stream's epoch end only. Passwords are
random, written once into the env files (0600, in a 0700 folder) and nowhere else: never printed
or logged. A second run replaces the files only with --force, which gives every role a new
password. How to run hsx with them: docs/operations/roles.md, "Least privilege: one NATS user per role".
This module talks to no NATS server.
"""

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from hsx.commands.configs import NatsConfigConfig
from hsx.errors import HsxError
from hsx.exitcodes import DONE
from hsx.storage.fsutil import atomic_write_bytes
from hsx.wire.permissions import ANY, ROLES, Permissions, inbox_prefix, role_permissions

AUTH_FILE = "nats-auth.conf"


def user_of(role: str, stream: str = ANY) -> str:
    """The NATS user of `role` (of one trainer stream's, with `stream`)."""
    return f"hsx-{role}" if stream == ANY else f"hsx-{role}-{stream}"


def env_file(role: str, stream: str = ANY) -> str:
    return f"{role}.env" if stream == ANY else f"{role}-{stream}.env"


def _users_of(streams: tuple[str, ...]) -> list[tuple[str, str]]:
    """(role, stream) per user: every role once, or the trainer once per stream name."""
    if not streams:
        return [(role, ANY) for role in ROLES]
    return [(role, ANY) for role in ROLES if role != "trainer"] + [("trainer", stream) for stream in streams]


@dataclass(frozen=True, kw_only=True)
class RoleUser:
    role: str
    stream: str  # ANY, or the one trainer stream the user is of
    user: str
    password: str
    permissions: Permissions


def _bcrypt(password: str, cost: int) -> str:
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=cost)).decode()


def _quoted(values: tuple[str, ...], indent: str) -> str:
    # A JSON string is a double-quoted string of nats-server's configuration format.
    return "\n".join(f"{indent}{json.dumps(value)}" for value in values)


def authorization_block(users: list[RoleUser], *, scope: str, cost: int) -> str:
    """The `authorization {}` block of nats-server's configuration for `users`."""
    entries = []
    for one in users:
        entries.append(
            f"""    {{
      # role {one.role}{"" if one.stream == ANY else f", stream {one.stream}"}
      user: {json.dumps(one.user)}
      password: {json.dumps(_bcrypt(one.password, cost))}
      permissions: {{
        publish: {{ allow: [
{_quoted(one.permissions.publish, "          ")}
        ] }}
        subscribe: {{ allow: [
{_quoted(one.permissions.subscribe, "          ")}
        ] }}
      }}
    }}"""
        )
    return (
        "# hsx: one NATS user per role, each allowed what that role does (hsx nats-config).\n"
        f"# Scope: {scope}. Passwords are bcrypt hashes; each role's password is in its <role>.env.\n"
        "# nats-server -js -c nats-auth.conf, or `include nats-auth.conf` in the server's configuration.\n"
        "authorization {\n  users = [\n" + "\n".join(entries) + "\n  ]\n}\n"
    )


def role_env(one: RoleUser, *, url: str | None) -> str:
    of = "" if one.stream == ANY else f" (JobStream name {one.stream})"
    lines = [
        f"# hsx role {one.role}{of}: NATS user {one.user} (hsx nats-config). Secret: keep it 0600.",
        f"HSX_NATS_USER={one.user}",
        f"HSX_NATS_PASSWORD={one.password}",
        f"HSX_NATS_INBOX_PREFIX={inbox_prefix(one.user)}",
    ]
    if url:
        lines.append(f"HSX_NATS_URL={url}")
    return "\n".join(lines) + "\n"


def _kept_password(path: Path, *, new_stream: bool) -> str:
    """The password an earlier run wrote into `path` (--update); a trainer stream the earlier run
    did not have (`new_stream`, its file missing) gets its first."""
    if new_stream and not path.exists():
        return secrets.token_urlsafe(24)
    try:
        text = path.read_text()
    except OSError as exc:
        raise HsxError(f"--update: cannot read {path} ({exc.strerror}); run without --update to write it") from None
    for line in text.splitlines():
        name, _, value = line.partition("=")
        if name == "HSX_NATS_PASSWORD" and value:
            return value
    raise HsxError(f"--update: {path} has no HSX_NATS_PASSWORD line (not written by hsx nats-config?)")


def _scope(jobs: tuple[str, ...], nodes: tuple[str, ...], streams: tuple[str, ...] = ()) -> str:
    on_jobs = "every job" if jobs == (ANY,) else "jobs " + ", ".join(jobs)
    on_nodes = "every node" if nodes == (ANY,) else "nodes " + ", ".join(nodes)
    on_streams = "; a trainer user per stream: " + ", ".join(streams) if streams else ""
    return f"{on_jobs}; {on_nodes}{on_streams}"


def write_nats_config(cfg: NatsConfigConfig) -> list[Path]:
    """Write the authorization block and the env files; the paths written, block first."""
    out = cfg.out
    if out.exists() and not out.is_dir():
        raise HsxError(f"--out {out}: not a directory")
    streams = cfg.trainer_streams or ()
    users_of = _users_of(streams)
    targets = [out / AUTH_FILE, *(out / env_file(role, stream) for role, stream in users_of)]
    existing = [str(path) for path in targets if path.exists()]
    if existing and not (cfg.force or cfg.keep_passwords):
        raise HsxError(
            f"--out {out} already holds {', '.join(existing[:3])}{' ...' if len(existing) > 3 else ''} "
            "from an earlier hsx nats-config: pass --update to keep the roles' passwords (a new scope), "
            "or --force to give every role a new one"
        )
    jobs, nodes = cfg.jobs or (ANY,), cfg.nodes or (ANY,)
    users = [
        RoleUser(
            role=role,
            stream=stream,
            user=user_of(role, stream),
            password=_kept_password(out / env_file(role, stream), new_stream=stream != ANY)
            if cfg.keep_passwords
            else secrets.token_urlsafe(24),
            permissions=role_permissions(role, user=user_of(role, stream), jobs=jobs, nodes=nodes, stream=stream),
        )
        for role, stream in users_of
    ]
    scope = _scope(jobs, nodes, streams)
    atomic_write_bytes(targets[0], authorization_block(users, scope=scope, cost=cfg.bcrypt_cost).encode())
    for one, path in zip(users, targets[1:]):
        atomic_write_bytes(path, role_env(one, url=cfg.url).encode())
    return targets


def run_nats_config(cfg: NatsConfigConfig) -> int:
    written = write_nats_config(cfg)
    auth, envs = written[0], written[1:]
    jobs, nodes, streams = cfg.jobs or (ANY,), cfg.nodes or (ANY,), cfg.trainer_streams or ()
    users = ", ".join(user_of(role, stream) for role, stream in _users_of(streams))
    print(f"wrote {auth}: users {users} ({_scope(jobs, nodes, streams)})")
    print(f"wrote each role's credentials (mode 0600): {', '.join(str(path) for path in envs)}")
    print(f"start the server with it: nats-server -js -c {auth} (or include it from the server's configuration)")
    print(
        f"run each service with its role's file, e.g.: set -a; . {cfg.out / env_file('consumer')}; set +a; hsx consume ..."
    )
    return DONE
