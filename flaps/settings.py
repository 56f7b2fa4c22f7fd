"""flaps' settings: where to learn the fleet from, and how to rank it."""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_settings import SettingsConfigDict

from flaps.placement import DEFAULT_CURVE, Curve
from nonomad.runtime import ServiceSettings


class WeightSettings(BaseModel):
    model_config = {"extra": "forbid"}

    cpu: float = Field(default=1.0, ge=0)
    memory: float = Field(default=1.0, ge=0)
    image_cached: float = Field(default=0.5, ge=0, description="bonus for a cached image")
    spread: float = Field(default=1.0, ge=0, description="penalty per machine of the same app")


class FlapsSettings(ServiceSettings):
    """Settings of one flaps instance (any number may run; they share nothing)."""

    model_config = SettingsConfigDict(env_prefix="FLAPS_")

    workers: list[str] = Field(default_factory=list, description="worker addresses to follow")
    peers: list[str] = Field(default_factory=list, description="replicas to share members with")
    upstream: str | None = Field(default=None, description="follow this registry instead")
    suspect_after: float = Field(default=0.6, gt=0, description="s without heartbeat: suspect")
    dead_after: float = Field(default=1.0, gt=0, description="s without heartbeat: dead")
    sample_size: int = Field(default=8, ge=1, description="feasible workers ranked per region")
    curve: list[tuple[float, float]] = Field(
        default_factory=lambda: list(DEFAULT_CURVE.points),
        description="utility of utilization after placement, as [x, y] points spanning 0..1",
    )
    weights: WeightSettings = WeightSettings()

    @field_validator("curve")
    @classmethod
    def _curve(cls, value: list[tuple[float, float]]) -> list[tuple[float, float]]:
        Curve(tuple(value))  # raises ValueError with the reason
        return value

    @field_validator("dead_after")
    @classmethod
    def _dead_after(cls, value: float, info: ValidationInfo) -> float:
        suspect = info.data.get("suspect_after")
        if suspect is not None and value <= suspect:
            raise ValueError("must be greater than suspect_after")
        return value
