"""The Spark launcher: a barrier job of one agent per task, on a classic SparkContext or over Spark Connect."""
