"""Where job data lives: local paths, or object-store URIs (s3://, gs://).

uri.py       URIs as written in job.yaml (never normalised as local paths)
options.py   storage_options in job.yaml (what the environment cannot say)
base.py      the Storage interface the input side reads through (stat, Parquet, dataset)
local.py     local files: pyarrow opens the path, as batchrun always did
s3.py        S3: Parquet through pyarrow's S3FileSystem, ETags, listings and writes through boto3
gcs.py       GCS: Parquet through pyarrow's GcsFileSystem, generations, listings and writes through
             google-cloud-storage
retry.py     how transient failures are retried (botocore, google.api_core and pyarrow)
errors.py    permanent failures -> exit 7, naming the URI and the fix
registry.py  storage_for(path, options, field): the Storage for a path
"""
