# Stand-in for MinIO (server and mc) where no image registry answers: moto's S3 server, kept on
# the /data volume (s3_server.py), with MinIO's command line and the `mc` subcommands
# compose.yaml runs. Built with the repository as context (scripts/compose-local.sh).
ARG PYTHON_IMAGE=dflash-standin/python:3.11
FROM ${PYTHON_IMAGE}
ARG MOTO=moto[server]==5.2.6
# The CA bundle only (docker/wheelhouse also holds the torch wheel, which this image needs not).
COPY docker/wheelhouse/README.md docker/wheelhouse/*.crt /tmp/wheelhouse/
RUN if [ -f /tmp/wheelhouse/ca-bundle.crt ]; then export PIP_CERT=/tmp/wheelhouse/ca-bundle.crt; fi \
    && pip install --no-cache-dir "$MOTO" \
    && rm -rf /tmp/wheelhouse \
    && useradd --create-home --uid 1000 s3 && mkdir -p /data && chown s3:s3 /data
COPY docker/standins/s3_server.py /usr/local/lib/s3_server.py
COPY docker/standins/mc /usr/local/bin/mc
USER s3
EXPOSE 9000
ENTRYPOINT ["python3", "/usr/local/lib/s3_server.py"]
CMD ["server", "/data"]
