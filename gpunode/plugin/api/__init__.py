"""The deviceplugin v1beta1 API: deviceplugin.proto and the stubs generated from it (do not edit them)."""
