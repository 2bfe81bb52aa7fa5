"""``mla-report``: what each quantization recipe does to DeepSeek-V3-shaped MLA attention."""

from mla_report.report import BUILTIN_NAMES as BUILTIN_NAMES
from mla_report.report import RECIPES as RECIPES
from mla_report.report import Case as Case
from mla_report.report import Recipe as Recipe
from mla_report.report import check_recipe as check_recipe
from mla_report.report import main as main
from mla_report.report import parse_recipe as parse_recipe
from mla_report.report import run_report as run_report
from mla_report.report import write_outputs as write_outputs

__version__ = "0.1.0"
