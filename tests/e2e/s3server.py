"""The e2e test's S3: moto's S3-compatible server on loopback with MODEL uploaded as
s3://models/smollm2/<file name> (access key e2e-key, secret e2e-secret). Prints its URL,
then serves until killed. Usage: s3server.py MODEL.gguf"""
import os
import sys
import time

import boto3
from moto.server import ThreadedMotoServer

server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
url = f"http://{host}:{port}"
s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                  aws_access_key_id="e2e-key", aws_secret_access_key="e2e-secret")
s3.create_bucket(Bucket="models")
s3.upload_file(sys.argv[1], "models", "smollm2/" + os.path.basename(sys.argv[1]))
print(url, flush=True)
while True:
    time.sleep(3600)
