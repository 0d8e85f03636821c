"""The htmx dashboard: sign-in, API keys, runs, playground, models, admin, and the offline GraphiQL page.

Handlers call `app.services` only; `routes()` and `middleware()` are what `app.server` mounts.
"""

from web.app import middleware, routes

__all__ = ["middleware", "routes"]
