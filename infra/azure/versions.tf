terraform {
  required_version = ">= 1.5"
  required_providers {
    azurerm = {
      source = "hashicorp/azurerm"
      # 4.9 is the first with `features.storage.data_plane_available`
      version = "~> 4.9"
    }
  }
}

# The job store's account has shared keys off (`shared_access_key_enabled = false`), so the provider must
# not use them (terraform-provider-azurerm#27752: otherwise `apply` fails reading the new account's queue
# and blob service properties with 403 KeyBasedAuthenticationNotPermitted):
# - `storage_use_azuread`: whatever the provider does on a storage data plane goes with the Entra ID token
#   of whoever runs terraform, never the account key;
# - `data_plane_available = false`: the storage account itself is made and read through Resource Manager
#   only (no queue_properties or static_website blocks here, which would need the data plane), and the
#   `jobs` container is made through Resource Manager too (`storage_account_id`), so `apply` needs no
#   Storage data role for the person running it.
provider "azurerm" {
  features {
    storage {
      data_plane_available = false
    }
  }
  subscription_id     = var.subscription_id
  storage_use_azuread = true
}
