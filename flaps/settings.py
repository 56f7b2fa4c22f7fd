"""flaps' settings: where to learn the fleet from, and how to rank it."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import SettingsConfigDict

from flaps.placement import DEFAULT_CURVE, Curve
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

    @field_validator("curve")
    @classmethod
    def _curve(cls, value: list[tuple[float, float]]) -> list[tuple[float, float]]:
        Curve(tuple(value))  # raises ValueError with the reason
        return value
