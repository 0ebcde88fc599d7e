"""Model families, one file each, registered by name (``create_model``)."""

from unsparse.models import small_cnn, torchvision_models
from unsparse.models.registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model", "small_cnn", "torchvision_models"]
