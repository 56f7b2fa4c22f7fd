"""The web console (`nonomad-console`): a read-only view of the fleet, its apps and machines,
why each machine is on its worker, and what happens as it happens.

`main` runs it; `app` has its routes, `pages` where each page's data comes from, `model` that
data as plain dicts (every page's JSON twin), `render` the HTML, `live` and `streams` the
server-sent events that keep open pages current.
"""
