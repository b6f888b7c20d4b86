#!/usr/bin/env python
"""python scripts/launch_sagemaker.py recipes/gptj/tp.yaml [key=value ...] [--instance-type ml.p4d.24xlarge ...]

Submits the recipe as a SageMaker training job; prints the job name and its console link. See --help.
"""

import sys

from parallel_finetune.sagemaker_job import main

if __name__ == "__main__":
    sys.exit(main())
