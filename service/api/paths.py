"""The path of a request within the app: the scope's path without the root path it is mounted at (the ASGI scope's
root_path: a mount, or a proxy's prefix), as the routes, the open health routes and the static answers all match it."""

from __future__ import annotations


def app_path(scope) -> str:
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path
