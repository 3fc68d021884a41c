"""The counters of a `HotCache` (`HotCache.cache_stats`), one object its parts count into."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheStats:
    """Counters since the last `reset`, each counted once per batch (`HotCache.cache_stats`
    says what each means). The cache's parts that count hold this one object: the plan's
    commit (hits, misses, evictions), the scratch area's release (evictions), the tier
    writes (writebacks), the direct map (hits), the locks (gradients dropped)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    writebacks: int = 0
    admissions_refused: int = 0
    gradients_dropped: int = 0

    def as_dict(self, admission: bool) -> dict[str, float]:
        """The counters by name, with ``hit_rate``; the admission's two only when it admits."""
        looked_up = self.hits + self.misses
        stats: dict[str, float] = {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "writebacks": self.writebacks,
        }
        if admission:
            stats["admissions_refused"] = self.admissions_refused
            stats["gradients_dropped"] = self.gradients_dropped
        stats["hit_rate"] = self.hits / looked_up if looked_up else 0.0
        return stats

    def reset(self) -> None:
        """Zero every counter."""
        self.hits = self.misses = self.evictions = self.writebacks = 0
        self.admissions_refused = self.gradients_dropped = 0
