"""The names Signal's Modal deployment goes by: the server looks the pool class up by them, `signal doctor` checks
them and `signal pull` reads the Volume, without importing the Modal app itself (gpu_runtime/modal_app.py)."""

APP_NAME = "signal"
CLASS_NAME = "Pool"
VOLUME_NAME = "signal-data"
HF_SECRET_NAME = "signal-hf"  # a Modal secret holding HF_TOKEN: gated base models (`modal secret create signal-hf HF_TOKEN=...`)
