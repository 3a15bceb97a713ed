"""Tables that look like users' ones, with structure known by construction, and scikit-learn's bundled tables.

Each generated table is a seeded function of (rows, seed): the same call gives the same frame, bit for bit.
Columns come in the dtypes real sources have (int64, int32, float32, bool, strings, nullable integers with
nulls) and the label is binary, several classes or a regression target. ``TableSpec.structure`` says what each
table holds; tests/bench/test_bench_tables.py checks the claims (nulls where stated, the imbalance, the range).

What a user declares (``TableSpec.inputs``: every column by kind) is what the benchmark prepares; the label
and nothing else is left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from bench.workloads.beside_boosting import BINARY, MULTICLASS, REGRESSION


@dataclass(frozen=True)
class TableSpec:
    name: str
    task: str  # binary | multiclass | regression
    label: str
    inputs: dict[str, str]  # column -> kind, as a user writes data.inputs
    structure: str  # what the table holds, in words (docs/benchmarks.md)
    build: Callable[[np.random.Generator, int], pd.DataFrame] | None = None
    nulls: tuple[str, ...] = ()  # columns that hold nulls by construction
    bundled: str = ""  # a scikit-learn loader's name (load_wine...) instead of ``build``
    extra: dict[str, float] = field(default_factory=dict)


def _hours(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Hours of day with a morning and an evening peak, as trips, orders or logins have."""
    peak = rng.choice([8.0, 18.0, 13.0], size=rows, p=[0.35, 0.35, 0.3])
    return np.mod(np.round(rng.normal(peak, 3.0)), 24).astype(np.int32)


def _dates(rng: np.random.Generator, rows: int) -> pd.DatetimeIndex:
    return pd.Timestamp("2025-01-01") + pd.to_timedelta(rng.integers(0, 365, size=rows), unit="D")


def _ids(rng: np.random.Generator, rows: int, prefix: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids drawn Zipf-like from ``count`` values, each id's hidden effect): a few ids are frequent, most rare."""
    weights = 1.0 / np.arange(1, count + 1) ** 0.8
    index = rng.choice(count, size=rows, p=weights / weights.sum())
    effect = rng.normal(0.0, 1.0, size=count)
    return np.array([f"{prefix}{i:05d}" for i in range(count)])[index], effect[index]


def _logistic(score: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-score))


def _nullable(values: np.ndarray, missing: np.ndarray, dtype: str) -> pd.Series:
    """``values`` as pandas' nullable ``dtype`` (Int64, Float32) with nulls where ``missing``."""
    series = pd.Series(values).astype(dtype)
    series[missing] = pd.NA
    return series


def trips_late(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    hour = _hours(rng, rows)
    date = _dates(rng, rows)
    route, route_effect = _ids(rng, rows, "R", 3000)
    carrier = rng.choice(["north", "south", "metro", "express", "night"], size=rows, p=[0.3, 0.3, 0.2, 0.15, 0.05])
    distance = rng.lognormal(2.0, 0.8, size=rows).astype(np.float32)  # km, heavy right tail
    stops = rng.poisson(6, size=rows).astype(np.int64)
    rush = np.exp(-((hour - 8.5) ** 2) / 4) + np.exp(-((hour - 17.5) ** 2) / 4)
    weekend = date.dayofweek.to_numpy() >= 5
    winter = np.cos(2 * np.pi * (date.dayofyear.to_numpy() - 15) / 365)
    score = (
        -1.7 + 1.3 * rush - 0.8 * weekend + 0.5 * winter + 0.6 * route_effect + 0.05 * stops
        + np.where(carrier == "express", 0.04, -0.01) * (distance - 8)  # a carrier x distance interaction
    )  # fmt: skip
    return pd.DataFrame(
        {
            "hour": hour,
            "weekday": date.dayofweek.to_numpy().astype(np.int32),
            "day_of_year": date.dayofyear.to_numpy().astype(np.int64),
            "route": route,
            "carrier": carrier,
            "distance_km": distance,
            "stops": stops,
            "late": (rng.random(rows) < _logistic(score)).astype(np.int64),
        }
    )


def card_fraud(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    hour = _hours(rng, rows)
    customer, customer_effect = _ids(rng, rows, "C", 5000)
    merchant_kind = rng.choice(["grocery", "fuel", "online", "travel", "electronics", "cash"], size=rows)
    amount = (rng.pareto(1.6, size=rows) * 20 + 1).astype(np.float32)  # heavy tail
    foreign = rng.random(rows) < 0.08
    risky = np.isin(merchant_kind, ["online", "electronics", "cash"])
    night = (hour <= 4) | (hour >= 23)
    score = (
        -6.3 + 1.5 * foreign + 1.2 * night + 0.4 * customer_effect
        + risky * 0.9 * np.log1p(amount) - (~risky) * 0.2 * np.log1p(amount)  # merchant kind x amount
    )  # fmt: skip
    return pd.DataFrame(
        {
            "customer": customer,
            "merchant_kind": merchant_kind,
            "amount": amount,
            "hour": hour,
            "foreign": foreign,
            "card_age_days": rng.integers(1, 3000, size=rows).astype(np.int64),
            "fraud": (rng.random(rows) < _logistic(score)).astype(np.int64),
        }
    )


def credit_default(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    age = rng.integers(19, 75, size=rows).astype(np.int32)
    income = rng.lognormal(10.5, 0.6, size=rows).astype(np.float32)
    debt_ratio = rng.beta(2, 5, size=rows).astype(np.float32)
    months_employed = rng.integers(0, 360, size=rows)
    home = rng.choice(["rent", "own", "mortgage", "other"], size=rows, p=[0.4, 0.2, 0.35, 0.05])
    purpose = rng.choice(["car", "home", "education", "business", "debt", "other"], size=rows)
    unemployed = rng.random(rows) < 0.07  # informative: months_employed is missing for them, and they default more
    score = -2.2 + 3.0 * debt_ratio - 0.6 * (np.log(income) - 10.5) - 0.004 * months_employed + 1.4 * unemployed
    score += np.where(purpose == "business", 0.8, 0.0) - 0.01 * (age - 40)
    return pd.DataFrame(
        {
            "age": age,
            "income": _nullable(income, rng.random(rows) < 0.05, "Float32"),  # missing at random
            "debt_ratio": debt_ratio,
            "months_employed": _nullable(months_employed, unemployed, "Int64"),  # missing, informatively
            "home": home,
            "purpose": purpose,
            "has_cosigner": rng.random(rows) < 0.1,
            "default": np.where(rng.random(rows) < _logistic(score), "yes", "no"),
        }
    )


def plan_choice(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    """Which of four plans a customer picks: region x age, device, income, usage."""
    age = rng.integers(18, 80, size=rows).astype(np.int64)
    region = rng.choice(["north", "south", "east", "west", "centre", "islands"], size=rows)
    device = rng.choice(["ios", "android", "web", "tv"], size=rows, p=[0.35, 0.4, 0.2, 0.05])
    usage = rng.gamma(2.0, 5.0, size=rows).astype(np.float32)
    income = rng.lognormal(10.3, 0.5, size=rows).astype(np.float32)
    young_south = np.isin(region, ["south", "islands"]) * (age < 30)
    logits = np.stack(
        [
            np.zeros(rows),
            0.08 * usage - 0.5 + 1.2 * young_south,
            0.9 * (np.log(income) - 10.3) + 0.6 * (device == "ios") + 0.02 * (age - 45),
            0.05 * usage + 0.8 * (device == "tv") - 1.0 + 0.03 * (age - 45) * (region == "north"),
        ],
        axis=1,
    )
    gumbel = -np.log(-np.log(rng.random((rows, 4))))
    return pd.DataFrame(
        {
            "age": age,
            "region": region,
            "device": device,
            "monthly_gb": usage,
            "income": income,
            "has_family": rng.random(rows) < 0.3,
            "plan": np.array(["basic", "data", "premium", "family"])[np.argmax(logits + gumbel, axis=1)],
        }
    )


def house_prices(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    """Sale prices from about 10^4 to 10^7: area, neighbourhood (800), year built, month sold."""
    neighbourhood, place = _ids(rng, rows, "N", 800)
    kind = rng.choice(["flat", "house", "villa", "farm"], size=rows, p=[0.5, 0.35, 0.1, 0.05])
    area = rng.lognormal(4.4, 0.55, size=rows).astype(np.float32)
    rooms = np.clip(np.round(area / 25 + rng.normal(0, 1, rows)), 1, 20).astype(np.int32)
    year_built = rng.integers(1880, 2025, size=rows).astype(np.int64)
    month = rng.integers(1, 13, size=rows).astype(np.int32)
    garage = rng.random(rows) < 0.4
    per_m2 = np.exp(7.6 + 0.9 * place + np.where(kind == "villa", 0.5, 0.0) - 0.4 * (kind == "farm"))
    price = per_m2 * area * (1 + 0.1 * garage) * (1 + 0.04 * np.sin(2 * np.pi * month / 12))
    price *= np.where(year_built > 2010, 1.2, 1.0) * rng.lognormal(0, 0.15, size=rows)
    lot = _nullable(rng.lognormal(6, 1, size=rows).astype(np.float32), kind == "flat", "Float32")  # flats: none
    return pd.DataFrame(
        {
            "neighbourhood": neighbourhood,
            "kind": kind,
            "area_m2": area,
            "rooms": rooms,
            "year_built": year_built,
            "month_sold": month,
            "garage": garage,
            "lot_m2": lot,
            "price": price.astype(np.float64),
        }
    )


def store_sales(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    """Units a store sells in a day: weekday and season, promotions, store (2000) x price."""
    store, store_effect = _ids(rng, rows, "S", 2000)
    date = _dates(rng, rows)
    weekday = date.dayofweek.to_numpy()
    promo = rng.random(rows) < 0.2
    price = rng.uniform(1, 20, size=rows).astype(np.float32)
    category = rng.choice(["food", "drinks", "household", "toys", "garden"], size=rows)
    season = np.where(category == "garden", 0.8, 0.1) * np.sin(2 * np.pi * (date.dayofyear.to_numpy() - 80) / 365)
    elasticity = np.where(category == "food", -0.05, -0.12)  # category x price
    rate = np.exp(2.5 + 0.7 * store_effect + 0.3 * (weekday >= 5) + 0.6 * promo + season + elasticity * price)
    return pd.DataFrame(
        {
            "store": store,
            "category": category,
            "weekday": weekday.astype(np.int32),
            "day_of_year": date.dayofyear.to_numpy().astype(np.int32),
            "promo": promo,
            "price": price,
            "units": rng.poisson(rate).astype(np.int64),
        }
    )


def insurance_claims(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    """Claim amounts (heavy-tailed, a few to thousands): vehicle kind x driver age, region, nulls at random."""
    age = rng.integers(18, 90, size=rows).astype(np.int64)
    vehicle = rng.choice(["car", "van", "motorbike", "truck"], size=rows, p=[0.6, 0.15, 0.15, 0.1])
    region = rng.choice([f"region-{i}" for i in range(40)], size=rows)
    value = rng.lognormal(9.5, 0.7, size=rows).astype(np.float32)
    young_bike = (vehicle == "motorbike") * np.clip(30 - age, 0, None)
    log_claim = 4.0 + 0.5 * np.log(value / 1e4) + 0.12 * young_bike + 0.8 * (vehicle == "truck")
    claim = np.exp(log_claim + rng.normal(0, 0.8, size=rows))
    return pd.DataFrame(
        {
            "driver_age": age,
            "vehicle": vehicle,
            "region": region,
            "vehicle_value": _nullable(value, rng.random(rows) < 0.04, "Float32"),
            "years_insured": _nullable(rng.integers(0, 40, size=rows), rng.random(rows) < 0.04, "Int64"),
            "claim": claim,
        }
    )


def ticket_priority(rng: np.random.Generator, rows: int) -> pd.DataFrame:
    """Five priorities, imbalanced (most "low"): product x hour, tier, informative nulls, account id (4000)."""
    hour = _hours(rng, rows)
    account, account_effect = _ids(rng, rows, "A", 4000)
    product = rng.choice(["billing", "login", "api", "mobile", "reports"], size=rows)
    tier = rng.choice(["free", "pro", "enterprise"], size=rows, p=[0.6, 0.3, 0.1])
    never_contacted = rng.random(rows) < 0.15  # last_contact_days is missing: a new customer
    last_contact = rng.exponential(30, size=rows)
    urgency = (
        0.9 * (tier == "enterprise") + 0.7 * ((product == "api") & ((hour < 7) | (hour > 20)))
        + 0.5 * account_effect + 0.8 * never_contacted - 0.01 * last_contact + rng.logistic(0, 0.6, rows)
    )  # fmt: skip
    priority = np.digitize(urgency, [0.4, 1.1, 1.7, 2.4])
    return pd.DataFrame(
        {
            "account": account,
            "product": product,
            "tier": tier,
            "hour": hour,
            "last_contact_days": _nullable(last_contact.astype(np.float32), never_contacted, "Float32"),
            "attachments": rng.poisson(0.5, size=rows).astype(np.int32),
            "priority": np.array(["low", "normal", "high", "urgent", "critical"])[priority],
        }
    )


def kinds(numeric: str, categorical: str) -> dict[str, str]:
    """``data.inputs`` in short form: the space-separated numeric columns, then the categorical ones."""
    return {**dict.fromkeys(numeric.split(), "numeric"), **dict.fromkeys(categorical.split(), "categorical")}


GENERATED = (
    TableSpec(
        "trips_late",
        BINARY,
        "late",
        kinds("hour weekday day_of_year distance_km stops", categorical="route carrier"),
        "is a trip late: rush hours, weekends and winter, route id (3,000, Zipf), carrier x distance, "
        "heavy-tailed distance; ~20% late",
        trips_late,
    ),
    TableSpec(
        "card_fraud",
        BINARY,
        "fraud",
        kinds("amount hour foreign card_age_days", categorical="customer merchant_kind"),
        "fraud, ~2% positive: Pareto amounts x merchant kind, night hours, customer id (5,000), bool foreign",
        card_fraud,
    ),
    TableSpec(
        "credit_default",
        BINARY,
        "default",
        kinds("age income debt_ratio months_employed has_cosigner", categorical="home purpose"),
        "default (yes/no): nulls at random in income (5%), informative nulls in months_employed (the unemployed, "
        "7%, who default more), log-normal income",
        credit_default,
        nulls=("income", "months_employed"),
    ),
    TableSpec(
        "plan_choice",
        MULTICLASS,
        "plan",
        kinds("age monthly_gb income has_family", categorical="region device"),
        "4 plans (strings): region x age, device, income, usage",
        plan_choice,
    ),
    TableSpec(
        "ticket_priority",
        MULTICLASS,
        "priority",
        kinds("hour last_contact_days attachments", categorical="account product tier"),
        "5 priorities, imbalanced: product x hour of day, tier, account id (4,000), informative nulls in "
        "last_contact_days (15%: new customers, more urgent)",
        ticket_priority,
        nulls=("last_contact_days",),
    ),
    TableSpec(
        "house_prices",
        REGRESSION,
        "price",
        kinds("area_m2 rooms year_built month_sold garage lot_m2", categorical="neighbourhood kind"),
        "price from ~10^4 to ~10^7 (multiplicative): neighbourhood (800), kind, log-normal area, month sold; "
        "lot_m2 null for every flat (informative, ~50%)",
        house_prices,
        nulls=("lot_m2",),
    ),
    TableSpec(
        "store_sales",
        REGRESSION,
        "units",
        kinds("weekday day_of_year promo price", categorical="store category"),
        "units sold (Poisson counts, 0 to hundreds): store id (2,000), weekday and season (garden x date), "
        "promotions, category x price",
        store_sales,
    ),
    TableSpec(
        "insurance_claims",
        REGRESSION,
        "claim",
        kinds("driver_age vehicle_value years_insured", categorical="vehicle region"),
        "claim amount, log-normal (a few to thousands): vehicle x driver age, region (40), nulls at random in two "
        "columns (4% each)",
        insurance_claims,
        nulls=("vehicle_value", "years_insured"),
    ),
)

BUNDLED = (
    TableSpec(
        "breast_cancer",
        BINARY,
        "target",
        {},
        "scikit-learn's load_breast_cancer: 569 rows, 30 numeric",
        bundled="load_breast_cancer",
    ),
    TableSpec(
        "wine",
        MULTICLASS,
        "target",
        {},
        "scikit-learn's load_wine: 178 rows, 13 numeric, 3 classes",
        bundled="load_wine",
    ),
    TableSpec(
        "digits",
        MULTICLASS,
        "target",
        {},
        "scikit-learn's load_digits: 1,797 rows, 64 pixels (0-16), 10 classes",
        bundled="load_digits",
    ),
    TableSpec(
        "diabetes",
        REGRESSION,
        "target",
        {},
        "scikit-learn's load_diabetes: 442 rows, 10 numeric",
        bundled="load_diabetes",
    ),
)
TABLES = GENERATED + BUNDLED


def generate(spec: TableSpec, rows: int, seed: int = 0) -> pd.DataFrame:
    """The table: ``spec.build`` on its own stream of (seed, table), or the bundled one (all its rows)."""
    if spec.bundled:
        from sklearn import datasets

        bunch = getattr(datasets, spec.bundled)(as_frame=True)
        return bunch.frame.rename(columns=lambda name: re.sub(r"[^0-9A-Za-z_]+", "_", str(name)))
    index = [spec.name for spec in GENERATED].index(spec.name)
    return spec.build(np.random.default_rng([seed, index]), rows)


def inputs_of(spec: TableSpec, frame: pd.DataFrame) -> dict[str, str]:
    """``data.inputs`` as a user writes it: the spec's kinds, or every bundled column as numeric."""
    return dict(spec.inputs) or {name: "numeric" for name in frame.columns if name != spec.label}
