"""Models and data for jaxcomm's training entry point and benchmarks.

Flax NNX models (``mlp``, ``cnn``, ``resnet20``, ``charlm``,
``transformer``) behind a name
registry, a pure ``apply(params, x)`` view of any of them for Optax-style
training steps, their losses, and offline datasets in ``models.data``.

Example:
  >>> import models
  >>> apply, params, _ = models.functional(models.create("cnn"))
  >>> loss_fn = models.make_loss_fn("cnn", apply)
"""

from models import data as data
from models._functional import Functional as Functional
from models._functional import batch_keys as batch_keys
from models._functional import functional as functional
from models._functional import loss_and_metrics as loss_and_metrics
from models._functional import make_loss_fn as make_loss_fn
from models._registry import MODELS as MODELS
from models._registry import PARTITION_SPECS as PARTITION_SPECS
from models._registry import TASKS as TASKS
from models._registry import create as create
from models.charlm import CharLM as CharLM
from models.cnn import CNN as CNN
from models.mlp import MLP as MLP
from models.resnet import BasicBlock as BasicBlock
from models.resnet import ResNet as ResNet
from models.resnet import resnet20 as resnet20
from models.transformer import TransformerLM as TransformerLM
