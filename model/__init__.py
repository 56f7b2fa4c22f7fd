"""The machine model: the rules of the machine contract that every service applies, once.

flyd, the registry, flaps and the proxy stand side by side on this floor (above `runtime`),
and none of them imports another's package: what they must agree on lives here. How a slot's
members are ordered and promoted (`slots`), which of them a call may name (`scope`), what a
machine config may say and its limits (`validate`), the checks a machine declares (`checks`),
how a list of machines is paged (`pages`), the token format and its caveats (`tokens`), the
errors the machine API answers with (`errors`), and what an image is called, who may run it
and how an image source is read (`images`).

Nothing here holds state or serves anything; it imports only `runtime` and the generated
contracts (`flyd.v1`, ...).
"""
