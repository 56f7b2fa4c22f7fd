"""flaps' settings: where to learn the fleet from, how to rank it, whose tokens to accept, where
to read images' owners."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from flaps.placement import DEFAULT_CURVE, Curve
from flaps.service import KEY_DOUBT, STREAMS_PER_CALLER, VOUCH_MARGIN
from model.tokens import REVOKED_FILE, Keyring, parse_revoked
from registry.settings import ReplicaSettings


class WeightSettings(BaseModel):
    model_config = {"extra": "forbid"}

    cpu: float = Field(default=1.0, ge=0)
    memory: float = Field(default=1.0, ge=0)
    image_cached: float = Field(default=0.5, ge=0, description="bonus for a cached image")
    spread: float = Field(default=1.0, ge=0, description="penalty per machine of the same app")


class FlapsSettings(ReplicaSettings):
    """Settings of one flaps instance (any number may run; they share nothing)."""

    model_config = SettingsConfigDict(env_prefix="FLAPS_")

    sample_size: int = Field(default=8, ge=1, description="feasible workers ranked per region")
    curve: list[tuple[float, float]] = Field(
        default_factory=lambda: list(DEFAULT_CURVE.points),
        description="utility of utilization after placement, as [x, y] points spanning 0..1",
    )
    weights: WeightSettings = WeightSettings()
    streams_per_caller: int = Field(
        default=STREAMS_PER_CALLER,
        gt=0,
        description="followed logs, and waits, one token (or cluster part) may have open at "
        "once, each kind counted apart: one more is RESOURCE_EXHAUSTED",
    )
    token_keys: Path | None = Field(
        default=None,
        description="file of root keys (`nonomad tokens keygen`, mode 0600): every call to the "
        "Machines and Platform APIs needs a token one of them signed; re-read when it changes",
    )

    revoked_tokens: Path | None = Field(
        default=None,
        description="file of revoked token ids, one a line (`nonomad tokens revoke`); default: "
        "revoked-tokens beside token_keys; re-read when it changes, a missing file revokes none",
    )

    key_doubt: float = Field(
        default=KEY_DOUBT,
        ge=0,
        description="seconds a create under an idempotency key waits for a silent worker of "
        "its region, which may hold the key's machine unseen (UNAVAILABLE, KEY_IN_DOUBT: "
        "retry), before it places the key without it: past this, a worker cut off that long "
        "with the key's machine leaves the key two",
    )

    key_vouch_margin: float = Field(
        default=VOUCH_MARGIN,
        gt=0,
        description="seconds a worker's last heartbeat vouches for the keys it holds: more than "
        "the workers' heartbeat interval plus the clocks' skew and the transit (a worker heard "
        "from less lately is asked before a key is placed); a claim under a key may take this "
        "much less than its caller has left",
    )

    image_source: Path | None = Field(
        default=None,
        description="the workers' image source directory (or a copy of it): a create or "
        "update of an image its app may not run is refused before any worker is claimed on "
        "(without it, or for an image it lacks, the workers refuse it)",
    )

    @field_validator("token_keys")
    @classmethod
    def _token_keys(cls, value: Path | None) -> Path | None:
        if value is not None:
            Keyring.load(value)  # a KeysError is a ValueError naming what is wrong
        return value

    @model_validator(mode="after")
    def _revoked_tokens(self) -> FlapsSettings:
        path = self.revocation_list
        if path is not None and path.exists():
            parse_revoked(path.read_text(), str(path))  # a ValueError naming the line
        return self

    @property
    def revocation_list(self) -> Path | None:
        """Where the revoked token ids are (None: flaps checks no tokens)."""
        if self.token_keys is None:
            return None
        return self.revoked_tokens or self.token_keys.with_name(REVOKED_FILE)

    @field_validator("curve")
    @classmethod
    def _curve(cls, value: list[tuple[float, float]]) -> list[tuple[float, float]]:
        Curve(tuple(value))  # raises ValueError with the reason
        return value
