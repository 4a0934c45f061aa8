"""The embedded Kubernetes device plugin (deviceplugin v1beta1) behind `gpunode plugin run`."""
