# MinIO's stand-in for make compose-test: moto's S3 server (objects in memory), on the stand-in
# Python base. Built with the host network: pip reaches the package registry as this machine does.
ARG PYTHON_IMAGE=hsx-compose-test/python:3.11
FROM ${PYTHON_IMAGE}
ARG MOTO_SPEC="moto[server]"
RUN pip install --no-cache-dir "${MOTO_SPEC}" \
 && moto_server --help >/dev/null
EXPOSE 9000
ENTRYPOINT ["moto_server"]
CMD ["-H", "0.0.0.0", "-p", "9000"]
