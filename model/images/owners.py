"""Who may run an image: its owner app, the apps it is shared with, or every app when public.

An image is recorded as an app's in its manifest's annotations, written where it is built or
pushed for that app (`nonomad image build --app APP [--share-with A,B] [--public]`):

- `dev.nonomad.app`: the app that owns it;
- `dev.nonomad.shared-with`: other apps that may run it, comma-separated;
- `dev.nonomad.public`: `true` when every app may run it.

In the manifest, not beside it (an index entry, a file of the source), because the manifest is
what its digest names: a digest's owners never change, so a worker's cache and flaps may
remember them, a reference by digest carries them, and they travel with the image to a
registry (`docker buildx --annotation`, `oras`, `crane mutate` write the same field). Changing
who may run an image is making a new manifest, as a new tag's would be.

An image that records no owner and is not public is usable by no app: an image the operator
put in the source by hand (a `docker save` archive, a layout skopeo wrote) becomes usable when
the operator says for whom. What a mistake costs decides the default: an image run by an app
it was not meant for leaks its code and whatever it was built with, while an image refused
for want of an owner costs a rebuild, and the refusal says which flag to add.

The rule is here, below every service that applies it: flyd before it pulls anything for a
create or an update (the commit point), flaps before it claims on any worker. See
docs/images.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from model.errors import ImageError
from runtime.validate import is_name, quote

__all__ = [
    "NO_OWNER",
    "OWNER_ANNOTATION",
    "PUBLIC",
    "PUBLIC_ANNOTATION",
    "SHARED_ANNOTATION",
    "Owners",
]

OWNER_ANNOTATION = "dev.nonomad.app"
SHARED_ANNOTATION = "dev.nonomad.shared-with"
PUBLIC_ANNOTATION = "dev.nonomad.public"
# A share list names at most this many apps: more than that is what `public` is for.
MAX_SHARES = 64


@dataclass(frozen=True)
class Owners:
    """Who may run an image: `app` (its owner, "" for none), the apps it is `shared_with`,
    and whether it is `public`."""

    app: str = ""
    shared_with: frozenset[str] = field(default_factory=frozenset)
    public: bool = False

    @classmethod
    def of(cls, app: str = "", shared_with: Iterable[str] = (), *, public: bool = False) -> Owners:
        """Owners as a builder records them; raises ValueError naming a malformed app."""
        shares = frozenset(shared_with)
        for name in (app, *sorted(shares)) if app else sorted(shares):
            if not is_name(name):
                raise ValueError(f"{quote(name)} is not an app name")
        if shares and not app:
            raise ValueError("an image shared with other apps needs an owner app")
        if len(shares) > MAX_SHARES:
            raise ValueError(f"shared with {len(shares)} apps; at most {MAX_SHARES}")
        return cls(app=app, shared_with=shares - {app}, public=public)

    @classmethod
    def parse(cls, annotations: Mapping[str, str], where: str) -> Owners:
        """The owners a manifest's annotations record; ImageError naming `where` when they
        are malformed (an image that says something unclear about who may run it is not run)."""
        app = annotations.get(OWNER_ANNOTATION, "")
        shared = annotations.get(SHARED_ANNOTATION, "")
        public = annotations.get(PUBLIC_ANNOTATION, "false")
        if public not in ("true", "false"):
            raise ImageError(f"{where}: {PUBLIC_ANNOTATION} is {quote(public)}, not true or false")
        try:
            return cls.of(
                app, [s.strip() for s in shared.split(",") if s.strip()], public=public == "true"
            )
        except ValueError as err:
            raise ImageError(f"{where}: {OWNER_ANNOTATION}/{SHARED_ANNOTATION}: {err}") from None

    def annotations(self) -> dict[str, str]:
        """The manifest annotations that record these owners (none for an unowned image)."""
        out = {}
        if self.app:
            out[OWNER_ANNOTATION] = self.app
        if self.shared_with:
            out[SHARED_ANNOTATION] = ",".join(sorted(self.shared_with))
        if self.public:
            out[PUBLIC_ANNOTATION] = "true"
        return out

    def allows(self, app: str) -> bool:
        """Whether a machine of `app` may run the image."""
        return self.public or (bool(self.app) and (app == self.app or app in self.shared_with))

    def refusal(self, app: str, image: str) -> str | None:
        """Why a machine of `app` may not run `image` (the reference it was named by), or None
        when it may: what flyd and flaps answer, after the field `config.image`. `image` was
        checked as a reference already (at most 512 characters): it is quoted whole."""
        if self.allows(app):
            return None
        if not self.app:
            return (
                f"image '{image}' records no owner and is not public: the operator builds "
                "it for an app with `nonomad image build --app APP` (or `--public`)"
            )
        return f"image '{image}' is app {self.app}'s and not shared with app {app}"

    def __str__(self) -> str:
        """For a CLI or a console: `app demo, shared with a, b`, `public`, `no owner`."""
        parts = [f"app {self.app}"] if self.app else []
        if self.shared_with:
            parts.append(f"shared with {', '.join(sorted(self.shared_with))}")
        if self.public:
            parts.append("public")
        return ", ".join(parts) or "no owner"


NO_OWNER = Owners()
"""An image that records no owner: no app may run it (the default of a build)."""
PUBLIC = Owners(public=True)
"""An image every app may run (`nonomad image build --public`)."""
