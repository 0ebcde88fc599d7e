"""Model families, one file each, registered by name (``create_model``)."""

from unsparse.models import autoencoder1d, small_cnn, torchvision_models
from unsparse.models.registry import create_model, list_models, register_model

__all__ = ["autoencoder1d", "create_model", "list_models", "register_model", "small_cnn", "torchvision_models"]
