"""Templates gpunode renders onto hosts; read them with importlib.resources.files(__name__)."""
