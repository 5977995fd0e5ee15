"""User management: ``usersInfo``, ``createUser``, ``updateUser``, ``dropUser``, role grants.

Enough for drivers' test harnesses, which list and create users before their
tests. Roles are recorded and shown, never enforced: any authenticated user may
run every command (a coarse model, said so in ``docs/testing.md``). Only
mongod's built-in roles exist (no ``createRole``). Errors and messages are
mongod's (``src/mongo/db/commands/user_management_commands.cpp``).
"""

from __future__ import annotations

import uuid
from typing import Any

from ..core.auth import BUILTIN_ROLES, MECHANISMS, User, Users, credentials_for
from ..core.context import CommandContext
from ..core.errors import CommandError
from ..storage import type_name
from .spec import command


def _users(ctx: CommandContext) -> Users:
    return ctx.deployment.users


def _name(ctx: CommandContext) -> str:
    name = ctx.target
    if not isinstance(name, str) or not name:
        raise CommandError(
            14, f"BSON field '{ctx.name}' is the wrong type '{type_name(name)}', "
            "expected type 'string'"
        )  # fmt: skip
    return name


def _roles(ctx: CommandContext, *, required: bool) -> list[dict[str, str]] | None:
    """The command's ``roles`` as ``{role, db}`` documents (a bare name is a role of ``$db``)."""
    if "roles" not in ctx.body:
        if required:
            raise CommandError(
                40414, f"BSON field '{ctx.name}.roles' is missing but a required field"
            )
        return None
    roles = ctx.body["roles"]
    if not isinstance(roles, list):
        raise CommandError(
            14, f"BSON field '{ctx.name}.roles' is the wrong type '{type_name(roles)}', "
            "expected type 'array'"
        )  # fmt: skip
    out: list[dict[str, str]] = []
    for role in roles:
        if isinstance(role, str):
            parsed = {"role": role, "db": ctx.db}
        elif (
            isinstance(role, dict)
            and isinstance(role.get("role"), str)
            and isinstance(role.get("db"), str)
        ):
            parsed = {"role": role["role"], "db": role["db"]}
        else:
            raise CommandError(2, "Role names must be either strings or objects")
        if parsed["role"] not in BUILTIN_ROLES:
            raise CommandError(31, f"Could not find role: {parsed['role']}@{parsed['db']}")
        if parsed not in out:
            out.append(parsed)
    return out


def _mechanisms(ctx: CommandContext) -> list[str]:
    asked = ctx.body.get("mechanisms", list(MECHANISMS))
    if not isinstance(asked, list) or not asked:
        raise CommandError(2, "mechanisms field must not be empty")
    for mechanism in asked:
        if mechanism not in MECHANISMS:
            raise CommandError(2, f"Unknown auth mechanism '{mechanism}'")
    return [str(m) for m in asked]


def _password(ctx: CommandContext, user: str, *, required: bool) -> str | None:
    pwd = ctx.body.get("pwd")
    if pwd is None:
        if required:
            raise CommandError(
                2, "Must provide a 'pwd' field for all user documents, except those with "
                "'$external' as the user's source db"
            )  # fmt: skip
        return None
    if not isinstance(pwd, str) or not pwd:
        raise CommandError(2, "User passwords must not be empty")
    if ctx.body.get("digestPassword") is False:
        raise CommandError(
            2, "the simulator refuses digestPassword: false (it keeps SCRAM keys only)"
        )
    try:
        credentials_for(user, pwd, ())  # the simulator's limit: printable ASCII
    except ValueError as exc:
        raise CommandError(2, str(exc)) from None
    return pwd


def _not_found(ctx: CommandContext, user: str) -> CommandError:
    return CommandError(11, f"User '{user}@{ctx.db}' not found")


@command("createUser", write=True)
def create_user(ctx: CommandContext) -> dict[str, Any]:
    name = _name(ctx)
    roles = _roles(ctx, required=True)
    assert roles is not None
    mechanisms = _mechanisms(ctx)
    pwd = _password(ctx, name, required=True)
    assert pwd is not None
    users = _users(ctx)
    with users.lock:
        if users.get(ctx.db, name) is not None:
            raise CommandError(51003, f'User "{name}@{ctx.db}" already exists')
        users.put(User(name, ctx.db, uuid.uuid4(), credentials_for(name, pwd, mechanisms), roles))
    return {}


@command("updateUser", write=True)
def update_user(ctx: CommandContext) -> dict[str, Any]:
    name = _name(ctx)
    roles = _roles(ctx, required=False)
    pwd = _password(ctx, name, required=False)
    if pwd is None and roles is None and "mechanisms" not in ctx.body:
        raise CommandError(2, "Must specify at least one field to update in updateUser")
    users = _users(ctx)
    with users.lock:
        user = users.get(ctx.db, name)
        if user is None:
            raise _not_found(ctx, name)
        mechanisms = _mechanisms(ctx) if "mechanisms" in ctx.body else list(user.credentials)
        if pwd is not None:
            user.credentials = credentials_for(name, pwd, mechanisms)
        elif "mechanisms" in ctx.body:
            if not set(mechanisms) <= set(user.credentials):
                raise CommandError(
                    2, "mechanisms field must be a subset of previously set mechanisms"
                )
            user.credentials = {m: c for m, c in user.credentials.items() if m in mechanisms}
        if roles is not None:
            user.roles = roles
    return {}


@command("dropUser", write=True)
def drop_user(ctx: CommandContext) -> dict[str, Any]:
    name = _name(ctx)
    users = _users(ctx)
    with users.lock:
        if users.remove(ctx.db, name) is None:
            raise _not_found(ctx, name)
    return {}


@command("dropAllUsersFromDatabase", write=True)
def drop_all_users(ctx: CommandContext) -> dict[str, Any]:
    users = _users(ctx)
    with users.lock:
        gone = [u for u in users.all() if u.db == ctx.db]
        for user in gone:
            users.remove(user.db, user.name)
    return {"n": len(gone)}


@command("grantRolesToUser", write=True)
@command("revokeRolesFromUser", write=True)
def change_roles(ctx: CommandContext) -> dict[str, Any]:
    name = _name(ctx)
    roles = _roles(ctx, required=True)
    if not roles:
        raise CommandError(2, f'{ctx.name} command requires a non-empty "roles" array')
    users = _users(ctx)
    with users.lock:
        user = users.get(ctx.db, name)
        if user is None:
            raise _not_found(ctx, name)
        if ctx.name == "grantRolesToUser":
            user.roles += [role for role in roles if role not in user.roles]
        else:
            user.roles = [role for role in user.roles if role not in roles]
    return {}


def _wanted(ctx: CommandContext, value: Any) -> tuple[str, str]:
    """One ``usersInfo`` argument as ``(db, user)``."""
    if isinstance(value, str):
        return ctx.db, value
    if isinstance(value, dict) and isinstance(value.get("user"), str):
        db = value.get("db", ctx.db)
        if isinstance(db, str):
            return db, value["user"]
    raise CommandError(
        2, "User name must be either a string or an object with 'user' and 'db' fields"
    )


@command("usersInfo", locks=False)
def users_info(ctx: CommandContext) -> dict[str, Any]:
    """``{usersInfo: 1}`` (this database's users; ``forAllDBs`` every one), a name, a
    ``{user, db}`` document or a list of them; credentials are never shown."""
    arg = ctx.target
    users = _users(ctx)
    with users.lock:
        if isinstance(arg, (int, float)) and not isinstance(arg, bool) and arg == 1:
            everyone = ctx.body.get("forAllDBs") is True
            found = [u for u in users.all() if everyone or u.db == ctx.db]
        else:
            wanted = [_wanted(ctx, v) for v in (arg if isinstance(arg, list) else [arg])]
            found = [u for db, name in wanted if (u := users.get(db, name)) is not None]
        return {"users": [user.info() for user in found]}
