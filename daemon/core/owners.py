"""Who a batch belongs to, and what the site's table of owners says of them. Pure.

A batch's owner is the user and group that own its folder on the share, as the share reports
them (the held folder's ``fstat`` at intake): the one thing an expert cannot forge by writing a
manifest. The manifest's ``[owner]`` name is for display and mail only, never for accounting.

The site's table (``[accounts]`` in config.toml) maps a user or a group to what its batches are
charged to on Slurm (account, QOS, partition), to its turn in the daemon's fair order (weight,
cap on running jobs, share of an array's throttle) and to its quota. A user's rule comes first,
then the rule of the folder's group, then the default, field by field (a user's rule that names
only a QOS keeps its group's account). An owner in neither table gets the default, or is
refused, as the site chooses (``unknown``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace


class Period(enum.Enum):
    """The calendar period (UTC) a quota counts over."""

    DAY = "day"
    MONTH = "month"


@dataclass(frozen=True)
class Quota:
    """What one owner or group may use per period; None: no limit on that measure."""

    per: Period = Period.MONTH
    images: int | None = None
    cpu_hours: float | None = None
    gpu_hours: float | None = None

    @property
    def limited(self) -> bool:
        return any(v is not None for v in (self.images, self.cpu_hours, self.gpu_hours))

    def describe(self) -> str:
        """The quota in words: ``100,000 images, 50 GPU-hours per month``."""
        parts = []
        if self.images is not None:
            parts.append(f"{self.images:,} images")
        if self.cpu_hours is not None:
            parts.append(f"{self.cpu_hours:g} CPU-hours")
        if self.gpu_hours is not None:
            parts.append(f"{self.gpu_hours:g} GPU-hours")
        return f"{', '.join(parts) or 'no limit'} per {self.per.value}"


@dataclass(frozen=True)
class Rule:
    """One row of the site's table: None where the next rule (group, then default) decides."""

    account: str | None = None
    qos: str | None = None
    partition: str | None = None
    weight: float | None = None  # the owner's share of the slots against others' (default 1)
    max_running: int | None = None  # jobs of the owner live at once; 0: no cap
    array_throttle: int | None = None  # tasks of one of its arrays running at once; 0: the site's
    quota: Quota | None = None

    def over(self, below: Rule) -> Rule:
        """This rule with ``below``'s values where it says nothing."""
        return replace(self, **{
            f.name: getattr(below, f.name) for f in fields(self) if getattr(self, f.name) is None
        })  # fmt: skip


class FairBy(enum.Enum):
    """Whose turn it is: each owner's (user), or each group's."""

    OWNER = "owner"
    GROUP = "group"


@dataclass(frozen=True)
class Owner:
    """A batch folder's owner as the share reported it; names as this host resolves them
    (a number without a name here is shown as ``uid 1234`` and matches no rule by name)."""

    uid: int
    gid: int
    user: str
    group: str

    def subject(self, by: FairBy) -> str:
        """``user:alice`` or ``group:imaging``: the key of turns, quotas and counters."""
        return f"user:{self.user}" if by is FairBy.OWNER else f"group:{self.group}"

    def describe(self) -> str:
        return f"user {self.user} (uid {self.uid}), group {self.group} (gid {self.gid})"


UNKNOWN_OWNER = "unknown"  # the subject of batches taken in before owners were recorded


@dataclass(frozen=True)
class Charge:
    """What an owner's jobs carry to Slurm ('' where the site's executor setting applies)."""

    account: str = ""
    qos: str = ""
    partition: str = ""

    def describe(self) -> str:
        said = [f"{k} {v}" for k, v in (("account", self.account), ("QOS", self.qos),
                                        ("partition", self.partition)) if v]  # fmt: skip
        return ", ".join(said) or "the service's own account"


@dataclass(frozen=True)
class Terms:
    """What the table decides for one owner."""

    charge: Charge
    weight: float = 1.0
    max_running: int = 0  # 0: no cap
    array_throttle: int = 0  # 0: the site's executor setting
    user_quota: Quota | None = None  # the owner's own (its user rule's, or the default's)
    group_quota: Quota | None = None  # its folder group's, shared by the group's members


@dataclass(frozen=True)
class Accounts:
    """The site's table (``[accounts]``). ``refuse_unknown``: an owner matched by no user nor
    group rule is refused at intake instead of getting the default."""

    default: Rule = Rule()
    users: Mapping[str, Rule] = field(default_factory=dict)
    groups: Mapping[str, Rule] = field(default_factory=dict)
    refuse_unknown: bool = False
    fair_by: FairBy = FairBy.OWNER
    preempt: bool = True  # an owner over its share yields an inference job to one below it
    # … unless a live job is due to end within this many seconds of the waiting one's queueing
    preempt_grace: float = 30.0

    def known(self, owner: Owner) -> bool:
        return owner.user in self.users or owner.group in self.groups

    def admits(self, owner: Owner) -> bool:
        return self.known(owner) or not self.refuse_unknown

    def terms(self, owner: Owner | None) -> Terms:
        """What applies to ``owner`` (None: a batch taken in before owners were recorded,
        which gets the default)."""
        user = self.users.get(owner.user) if owner else None
        group = self.groups.get(owner.group) if owner else None
        merged = (user or Rule()).over(group or Rule()).over(self.default)
        turn = (user if self.fair_by is FairBy.OWNER else group) or Rule()
        turn = turn.over(self.default)
        user_quota = (user.quota if user else None) or self.default.quota
        return Terms(
            Charge(merged.account or "", merged.qos or "", merged.partition or ""),
            weight=turn.weight if turn.weight is not None else 1.0,
            max_running=turn.max_running or 0,
            array_throttle=turn.array_throttle or 0,
            user_quota=user_quota if user_quota and user_quota.limited else None,
            group_quota=group.quota if group and group.quota and group.quota.limited else None,
        )

    def subject(self, owner: Owner | None) -> str:
        """Whose turn a batch of ``owner`` takes (see :class:`FairBy`)."""
        return UNKNOWN_OWNER if owner is None else owner.subject(self.fair_by)


def refusal_text(owner: Owner) -> tuple[str, str]:
    """(what, next step) of the status line of a batch whose owner the site does not know."""
    return (
        f"is owned by {owner.describe()}, who has no account at this site",
        "ask an operator to add the user or the group to [accounts] in watchd's config.toml, "
        "then save the manifest again",
    )
