import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class FreshBuildPy(build_py):
    """Start the package's build folder empty: setuptools reuses build/lib, so a module deleted
    from the checkout (or a renamed config) went on shipping in every later wheel."""

    def run(self):
        shutil.rmtree(os.path.join(self.build_lib, 'ds_seg'), ignore_errors=True)
        super().run()


# The DeepSpeed JSONs and example configs live at the top of the checkout (ds_configs/, configs/)
# and are installed inside the package as ds_seg/ds_configs and ds_seg/configs (the sbatch
# templates of launch/slurm/ as ds_seg/slurm), so that
# `ds-seg-train --deepspeed_config zero2` finds them from any directory (ds_seg.config.DS_CONFIGS_DIR).
SHIPPED = {'ds_seg.ds_configs': ('ds_configs', ['*.json']), 'ds_seg.configs': ('configs', ['*.py']),
           'ds_seg.configs._base_': ('configs/_base_', ['*.py']),
           'ds_seg.slurm': ('launch/slurm', ['*.sbatch'])}  # ds-seg-train --sbatch-template
CONSOLE_SCRIPTS = [f'ds-seg-{name}=ds_seg.cli.{name}:main'
                   for name in ('train', 'predict', 'evaluate', 'export', 'benchmark', 'models')]

setup(
    name='ds_seg',
    version='0.1.0',
    description='DeepSpeed training for large semantic-segmentation models on aerial imagery',
    long_description=open('README.md').read() if os.path.exists('README.md') else '',
    long_description_content_type='text/markdown',
    packages=find_packages(include=['ds_seg', 'ds_seg.*']) + list(SHIPPED),
    package_dir={pkg: folder for pkg, (folder, _) in SHIPPED.items()},
    package_data={pkg: patterns for pkg, (_, patterns) in SHIPPED.items()},
    entry_points={'console_scripts': CONSOLE_SCRIPTS},
    cmdclass={'build_py': FreshBuildPy},
    python_requires='>=3.9',
    install_requires=[
        'torch>=2.6',      # torch.compiler.is_exporting, the torch.export-based ONNX exporter
        'deepspeed>=0.17',
        'mmengine>=0.10',
        'numpy',
        'tensorboard',
        'rasterio>=1.3',
        'timm>=1.0',
        'opencv-python',  # resize and erosion of windows; also what mmengine installs
        'shapely>=2.0',   # polygon output (union of band pieces), vector labels (STRtree)
        'pyogrio>=0.7',   # GeoPackage / GeoJSON / FlatGeobuf reading and writing
        'pystac>=1.8',    # STAC Item / ItemCollection input
        'matplotlib',     # evaluate.py's confusion.png and previews, the benchmark plot (mmengine needs it too)
    ],
    extras_require={
        'test': ['pytest>=7', 'pytest-timeout', 'pytest-xdist>=3.2', 'matplotlib',   # pytest -n 2 (tests/conftest.py)
                 'onnx>=1.15', 'onnxscript>=0.3', 'onnxruntime>=1.17',   # = the 'onnx' extra (export tests)
                 'mlflow-skinny>=2.10', 'wandb>=0.19'],  # = the 'mlflow' and 'wandb' extras (tracker test)
        'onnx': ['onnx>=1.15', 'onnxscript>=0.3', 'onnxruntime>=1.17'],  # export --format onnx, predict.py on .onnx
        'mlflow': ['mlflow-skinny>=2.10'],            # log.trackers=['mlflow']
        'wandb': ['wandb>=0.19'],                     # log.trackers=['wandb'] (reinit='create_new')
    },
)
