"""The progress lines `trainlift train` prints inside a submitted job (`--progress json`), which `submit --follow`
reads back from the job's log. A module of its own so that the CLI can name them without importing the job code."""

PROGRESS_PREFIX = "trainlift-progress "
PROGRESS_ENV = "TRAINLIFT_PROGRESS"  # set to json in a submitted job: `submit --follow` reads those lines
