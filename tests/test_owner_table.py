"""The site's table of owners and the quotas, as pure functions, and as config.toml says them."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import tomli_w

from daemon.contract.errors import ConfigError
from daemon.core.owners import Accounts, Charge, FairBy, Owner, Period, Quota, Rule
from daemon.core.quotas import Account, Used, parse_quota, period, quota_json, refusal
from daemon.site.config import parse_config

ANN = Owner(1001, 2001, "ann", "imaging")
BOB = Owner(1002, 2002, "bob", "physics")
EVE = Owner(1003, 2003, "eve", "visitors")

TABLE = Accounts(
    default=Rule(account="general", qos="normal", weight=1.0),
    users={"ann": Rule(qos="high", max_running=4, quota=Quota(Period.DAY, images=1000))},
    groups={
        "imaging": Rule(account="imaging", partition="gpu", weight=3.0, array_throttle=8),
        "physics": Rule(account="phys", quota=Quota(Period.MONTH, gpu_hours=10.0)),
    },
)


def test_a_users_rule_comes_first_then_the_folders_group_then_the_default_field_by_field() -> None:
    terms = TABLE.terms(ANN)
    assert terms.charge == Charge(account="imaging", qos="high", partition="gpu")
    assert terms.max_running == 4
    assert terms.user_quota == Quota(Period.DAY, images=1000)
    bob = TABLE.terms(BOB)
    assert bob.charge == Charge(account="phys", qos="normal", partition="")
    assert bob.group_quota == Quota(Period.MONTH, gpu_hours=10.0) and bob.user_quota is None


def test_turns_are_by_owner_or_by_group_with_the_weight_of_that_rule() -> None:
    assert TABLE.subject(ANN) == "user:ann" and TABLE.terms(ANN).weight == 1.0
    by_group = Accounts(default=TABLE.default, users=TABLE.users, groups=TABLE.groups,
                        fair_by=FairBy.GROUP)  # fmt: skip
    assert by_group.subject(ANN) == "group:imaging"
    assert by_group.terms(ANN).weight == 3.0 and by_group.terms(ANN).array_throttle == 8


def test_an_unknown_owner_gets_the_default_or_is_refused_as_the_site_chooses() -> None:
    assert TABLE.admits(EVE) and TABLE.terms(EVE).charge == Charge("general", "normal", "")
    strict = Accounts(default=TABLE.default, users=TABLE.users, groups=TABLE.groups,
                      refuse_unknown=True)  # fmt: skip
    assert strict.admits(ANN) and strict.admits(BOB) and not strict.admits(EVE)


def test_a_batch_taken_in_before_owners_were_recorded_gets_the_default() -> None:
    assert TABLE.subject(None) == "unknown"
    assert TABLE.terms(None).charge == Charge("general", "normal", "")


def at(text: str) -> float:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()


def test_quota_periods_are_utc_calendar_days_and_months() -> None:
    assert period(Period.DAY, at("2026-11-26 17:05")) == (at("2026-11-26"), at("2026-11-27"))
    assert period(Period.MONTH, at("2026-12-31 23:59")) == (at("2026-12-01"), at("2027-01-01"))


def account(quota: Quota, used: Used, subject: str = "user:ann") -> Account:
    since, frees = period(quota.per, at("2026-11-26 10:00"))
    return Account(subject, quota, used, since, frees)


def test_a_batch_over_the_quota_is_told_whose_quota_how_much_is_used_and_when_it_frees() -> None:
    held = account(Quota(Period.MONTH, images=1000), Used(images=980))
    assert refusal(held, 20) == ""
    assert refusal(held, 50) == (
        "over the monthly quota of user ann: 980 of 1,000 images used this month (this batch "
        "needs 50); it frees at 2026-12-01 00:00 UTC, or when an operator raises it "
        "(watchctl quota)"
    )


def test_a_batch_larger_than_the_whole_quota_is_told_only_an_operator_can_help() -> None:
    held = account(Quota(Period.DAY, images=10), Used(), subject="group:imaging")
    assert refusal(held, 11) == (
        "over the daily quota of group imaging: 0 of 10 images used today (this batch needs "
        "11, more than the whole quota); it does not free by itself: an operator must raise it "
        "(watchctl quota)"
    )


def test_hours_quotas_hold_a_batch_once_they_are_used_up() -> None:
    gpu = account(Quota(Period.MONTH, gpu_hours=10.0), Used(gpu_hours=10.5))
    assert refusal(gpu, 1).startswith(
        "over the monthly quota of user ann: 10.5 of 10 GPU-hours used this month"
    )
    assert refusal(account(Quota(Period.MONTH, cpu_hours=5.0), Used(cpu_hours=4.9)), 1) == ""


def test_an_operators_quota_travels_as_json_and_anything_else_is_refused() -> None:
    quota = Quota(Period.DAY, images=5, gpu_hours=1.5)
    assert parse_quota(quota_json(quota)) == quota
    assert parse_quota("") is None
    for bad in ('{"images": -1}', '{"images": 1.5}', '{"per": "week"}', '{"x": 1}', "[1]"):
        with pytest.raises(ValueError):
            parse_quota(bad)


def config(accounts: dict) -> dict:
    return {"roots": [{"path": "/srv/drop"}], "accounts": accounts}


def test_config_toml_accounts_become_the_table(tmp_path: Path) -> None:
    data = config({
        "fair_by": "group", "unknown": "refuse", "preempt": False,
        "default": {"account": "general", "quota": {"per": "day", "images": 100}},
        "users": {"ann": {"qos": "high", "max_running": 2}},
        "groups": {"imaging": {"account": "imaging", "weight": 2.5}},
    })  # fmt: skip
    (tmp_path / "c.toml").write_text(tomli_w.dumps(data))
    table = parse_config(data, source=tmp_path / "c.toml").accounts.table()
    assert table.fair_by is FairBy.GROUP and table.refuse_unknown and not table.preempt
    assert table.terms(ANN).charge == Charge("imaging", "high", "")
    assert table.terms(BOB).user_quota == Quota(Period.DAY, images=100)


def test_config_refuses_a_bad_account_name_and_unknown_keys_naming_them(tmp_path: Path) -> None:
    data = config({"users": {"ann": {"account": "lab; rm -rf /", "cost": 1}}})
    with pytest.raises(ConfigError) as caught:
        parse_config(data, source=tmp_path / "c.toml")
    said = str(caught.value)
    assert "accounts.users.ann.account" in said and "must be a Slurm name" in said
    assert "accounts.users.ann.cost" in said
