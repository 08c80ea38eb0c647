"""Spark's own output reaches the task log at the level it has, not as errors (the JVM's stderr)."""

from __future__ import annotations

import logging

from airflow_provider_hvd.hooks.spark_output import classify

# what a driver JVM prints on start-up, and when a SparkContext fails, as captured from pyspark 4.3
JVM_OUTPUT = """\
WARNING: Using incubator modules: jdk.incubator.vector
Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties
26/11/29 21:15:59 WARN NativeCodeLoader: Unable to load native-hadoop library for your platform... using builtin-java classes where applicable
26/11/29 21:16:02 INFO SparkContext: Running Spark version 4.3.0
\r[Stage 0:>                                                          (0 + 2) / 2]
26/11/29 21:22:22 ERROR SparkContext: Error initializing SparkContext.
org.apache.spark.SparkException: Could not parse Master URL: 'spark-master'
\tat org.apache.spark.SparkContext$.createTaskScheduler(SparkContext.scala:3300)
Caused by: java.net.ConnectException: Connection refused
\t... 12 more
java.base/java.lang.Thread.run(Thread.java:840)
[rank 1] epoch 1 done
Exception in thread "main" org.apache.spark.SparkException: Master must either be yarn or start with spark, k8s, or local
\tat org.apache.spark.deploy.SparkSubmit.error(SparkSubmit.scala:1068)
"""


def test_each_line_keeps_its_level_and_a_stack_trace_its_records():
    records = list(classify(JVM_OUTPUT.splitlines(keepends=True)))
    levels = [(logging.getLevelName(level), logger) for logger, level, _ in records]
    assert levels == [
        ("WARNING", "spark"),
        ("INFO", "spark"),
        ("WARNING", "spark.NativeCodeLoader"),
        ("INFO", "spark.SparkContext"),
        ("INFO", "spark"),  # a progress bar, if the user asked for one: its last redraw, as info
        *[("ERROR", "spark.SparkContext")] * 6,  # the error and its whole stack trace
        ("INFO", "spark"),  # a rank's line echoed by a local executor
        *[("ERROR", "spark")] * 2,  # the JVM's uncaught exception
    ]
    messages = [message for _, _, message in records]
    assert messages[2].startswith("Unable to load native-hadoop library")  # log4j's header is the record's own
    assert messages[4] == "[Stage 0:>                                                          (0 + 2) / 2]"
