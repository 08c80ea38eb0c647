"""The core runner: no Airflow in here. Its modules are grouped by the process they run in.

==================  ==========================================  ===============================================
package / module    runs in                                     what it does
==================  ==========================================  ===============================================
``runner``          the driver (the user's process)             :class:`HorovodRunner`, the public API
``errors``          the driver                                  the errors ``run()`` raises
``driver/``         the driver                                  the supervisor and the run's outcome, the agent
                                                                channel, Gloo's rendezvous, the launchers
                                                                (local, Spark) and what they ask of Spark
``agent/``          a Spark task (``np > 0``), a driver thread  one rank's agent: starts the rank process,
                    (``np < 0``)                                relays its output, reports how it ended
``reaper``          its own small process, between agent and    ends everything the rank started, however the
                    rank (standard library only)                agent dies
``rank/``           the rank process                            runs ``main``; ``log_to_driver``
``shared/``         all of them                                 the wire format and messages, the job's
                                                                pickling, Horovod's variables, GPU assignment
==================  ==========================================  ===============================================
"""

from .errors import HorovodRunnerError, LaunchError, RankFailedError, RunCancelledError, RunStalledError
from .rank.control import log_to_driver
from .runner import HorovodRunner

__all__ = [
    "HorovodRunner",
    "HorovodRunnerError",
    "LaunchError",
    "RankFailedError",
    "RunCancelledError",
    "RunStalledError",
    "log_to_driver",
]
