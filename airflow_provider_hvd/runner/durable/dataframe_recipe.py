"""A submitted run's DataFrame as its recipe: a SQL string, or a callable that receives a SparkSession and returns
the DataFrame (pickled as the job is). A DataFrame object belongs to the submitter's session, which the run's host
cannot use: the host builds the DataFrame from the recipe in its own session (the ranks' one), and the run goes on
as ``run()`` on a DataFrame does (:func:`..driver.launch.spark.dataframe_plan.plan_shards`, in the launcher).

What fails there (SQL that Spark refuses, a callable that raises or returns no DataFrame, the plan's refusals: a
column the ranks cannot read, no rows) ends the run as a :class:`~..errors.LaunchError` naming the problem, which
the client gets as the run's error.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import HorovodRunnerError, LaunchError, SettingError, SettingTypeError
from ..shared.naming import RunnerNaming

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger("airflow_provider_hvd.runner")

_EXAMPLE = "e.g. lambda spark: spark.table('training.samples').select('x', 'y')"


@dataclass(frozen=True)
class DataFrameRecipe:
    """How the run's host makes the run's DataFrame: ``sql``, or ``factory`` (a pickled callable) named ``name``."""

    sql: str | None = None
    factory: bytes | None = None
    name: str = ""

    @classmethod
    def of(cls, recipe: object, naming: RunnerNaming, method: str) -> DataFrameRecipe:
        """The recipe of ``recipe`` (a SQL string, or a callable, pickled here); TypeError for a DataFrame (with
        what to pass instead) or anything else, ValueError for an empty SQL string."""
        from pyspark.sql import DataFrame  # (Spark Connect's DataFrame is one too)

        from ..shared.payload import dumps_callable

        where = f"{naming.runner}.{method}"
        if isinstance(recipe, DataFrame):
            raise SettingTypeError(
                f"{where} takes the DataFrame's recipe, not a DataFrame: the run's host builds the DataFrame inside "
                "the cluster, in a Spark session of its own, where a DataFrame of this session cannot be used. "
                "Pass its SQL (a string), or a callable that receives a SparkSession and returns the DataFrame "
                f"({_EXAMPLE})."
            )
        if isinstance(recipe, str):
            if not recipe.strip():
                raise SettingError(f"{where}: the DataFrame's SQL is empty")
            return cls(sql=recipe)
        if callable(recipe):
            name = getattr(recipe, "__qualname__", None) or getattr(recipe, "__name__", None) or repr(recipe)
            return cls(factory=dumps_callable(recipe, "the DataFrame's callable"), name=name)
        raise SettingTypeError(
            f"{where} takes the DataFrame's SQL (a string) or a callable that receives a SparkSession and returns "
            f"the DataFrame, not {type(recipe).__name__}"
        )

    @property
    def size(self) -> int:
        """Its bytes in the host's spec (counted with the job's against the plan's limit)."""
        return len(self.factory or b"") + len((self.sql or "").encode())

    def describe(self) -> str:
        return "its SQL" if self.sql is not None else f"the callable {self.name}"

    def build(self, spark: Any) -> DataFrame:
        """The DataFrame, in the host's session ``spark``; what fails raises as it is (:meth:`failures` names it)."""
        from pyspark.sql import DataFrame

        log.info("building the run's DataFrame from %s in the run's host", self.describe())
        if self.sql is not None:
            df: DataFrame = spark.sql(self.sql)
            return df
        assert self.factory is not None
        factory: Callable[[Any], Any] = pickle.loads(self.factory)
        try:
            made = factory(spark)
        except Exception as exc:
            raise _CallableFailed() from exc
        if not isinstance(made, DataFrame):
            raise SettingTypeError(
                f"{self.name}(spark) returned a {type(made).__name__}, not a Spark DataFrame: return one made in the "
                "session it receives (spark.table(...), spark.sql(...), spark.range(...))"
            )
        return made

    @contextlib.contextmanager
    def failures(self, runner: str) -> Iterator[None]:
        """What fails inside, building the DataFrame or planning its shards, as the run's LaunchError naming the
        problem (a run's own error, a cancel among them, as it is)."""
        try:
            yield
        except HorovodRunnerError:
            raise
        except Exception as exc:  # noqa: BLE001 - Spark's errors, the callable's, the plan's: the run's error
            message = self.failed(runner, exc)
            if isinstance(exc, _CallableFailed):  # its traceback in the run's log (relayed to every client)
                log.warning("%s", message, exc_info=exc.__cause__)
            raise LaunchError(message) from None

    def failed(self, runner: str, exc: BaseException) -> str:
        from ..driver.launch.spark.cluster import summary

        if isinstance(exc, _CallableFailed) and exc.__cause__ is not None:  # its type says what it was
            text = f"{type(exc.__cause__).__name__}: {summary(exc.__cause__, first_line=True)}"
        else:  # Spark's refusal of the SQL, the plan's (no rows, a column the ranks cannot read)
            text = summary(exc, first_line=True)
        message = f"{runner}: the run's host could not use the DataFrame of {self.describe()}: {text}"
        return message + (f"\nSQL: {self.sql}" if self.sql is not None else "")


class _CallableFailed(Exception):
    """The recipe's callable raised (its error is the ``__cause__``)."""
